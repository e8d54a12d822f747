"""Built-in methods. Importing this package registers them.

Adding a method: one file here, one import line below, one test file.
"""
from . import awq, dynamic, gptq, none, rtn, smoothquant, static  # noqa: F401
from . import qat  # noqa: F401  (after the methods it builds on)
