"""quantlab: quantization experiments on small transformer language models.

>>> import quantlab
>>> model, tok = quantlab.load_model("smollm2-135m")
>>> quantlab.quantize(model, quantlab.RTNConfig(bits=4, group_size=64))

Extension points (docs/plugins.md): register_method + Method, register_format + Format / Element,
register_observer + Observer, register_extra + RunExtra, and load_plugins (what `plugins = [...]` in an experiment
file calls).
"""
from . import extras, methods  # noqa: F401  (registers the built-in methods and run extras)
from .backends.ckpt_import import load_quantized_checkpoint
from .backends.serialize import load_quantized, save_quantized
from .core.elements import Element
from .core.extras import RunExtra, get_extra, known_extras, register_extra
from .core.formats import Format, register_format
from .core.lifecycle import quantize, run_calibration, select_linears
from .core.observers import Observer, register_observer
from .core.qlinear import QuantLinear, WeightSpec
from .core.registry import LayerSelection, Method, get_method, known_methods, make_config, register_method
from .eval import measure_latency, perplexity, reference_logprobs, weight_stats
from .methods.any4 import Any4Config
from .methods.autoround import AutoRoundConfig
from .methods.awq import AWQConfig
from .methods.dynamic import DynamicConfig
from .methods.gptaq import GPTAQConfig
from .methods.gptq import GPTQConfig
from .methods.hqq import HQQConfig
from .methods.lora import LoRAConfig
from .methods.none import NoneConfig
from .methods.qat import QATConfig
from .methods.rtn import RTNConfig
from .methods.smoothquant import SmoothQuantConfig
from .methods.static import StaticConfig
from .models.data import calibration_windows, eval_windows, load_token_ids
from .models.loading import load_model, model_info
from .runs.experiment import load_experiment, parse_experiment
from .runs.runner import run_experiment
from .util.plugins import PluginError, load_plugins

__all__ = [
    # the lifecycle and the harness
    "quantize", "run_calibration", "select_linears", "calibration_windows", "eval_windows", "load_token_ids",
    "measure_latency", "perplexity", "reference_logprobs", "weight_stats", "load_model", "model_info",
    "load_quantized", "save_quantized", "load_quantized_checkpoint", "QuantLinear", "WeightSpec",
    # methods by config
    "NoneConfig", "RTNConfig", "GPTQConfig", "GPTAQConfig", "HQQConfig", "AWQConfig", "AutoRoundConfig", "DynamicConfig",
    "StaticConfig", "SmoothQuantConfig", "QATConfig", "LoRAConfig", "Any4Config", "get_method", "known_methods",
    "make_config",
    # experiments
    "load_experiment", "parse_experiment", "run_experiment",
    # extension points: plug in your own (docs/plugins.md)
    "Method", "LayerSelection", "register_method", "Format", "Element", "register_format", "Observer",
    "register_observer", "RunExtra", "register_extra", "get_extra", "known_extras", "load_plugins", "PluginError",
]
