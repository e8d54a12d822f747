"""Built-in methods; importing this package registers them.

Adding a method: one file here, one import line below, one test file.
"""
from . import any4, autoround, awq, checkpoint, dynamic, gguf, gptaq, gptq, hqq, lora, none, qat, rtn, smoothquant, static  # noqa: F401
