"""Built-in run extras; importing this package registers them, in the order they apply.

Adding one: a file here with a RunExtra (quantlab/core/extras.py) and one import line below. Nothing else changes:
parsing, run keys, the runner, the TOML writer, the backends' refusals and the report loop over the registry.
"""
from . import rotation, embedding, kv_cache  # noqa: F401, I001  (registry order = apply order within a stage)
