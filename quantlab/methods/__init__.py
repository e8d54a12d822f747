"""Built-in methods. Importing this package registers them.

Adding a method: one file here, one import line below, one test file.
"""
from . import gptq, none, rtn  # noqa: F401
from . import dynamic, smoothquant, static  # noqa: F401
