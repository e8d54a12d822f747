"""Built-in methods. Importing this package registers them.

Adding a method: one file here, one import line below, one test file.
"""
from . import none, rtn  # noqa: F401
