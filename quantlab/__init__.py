"""quantlab: quantization experiments on small transformer language models.

>>> import quantlab
>>> model, tok = quantlab.load_model("smollm2-135m")
>>> quantlab.quantize(model, quantlab.RTNConfig(bits=4, group_size=64))
"""
from . import extras, methods  # noqa: F401  (registers the built-in methods and run extras)
from .backends.serialize import load_quantized, save_quantized
from .core.lifecycle import quantize, run_calibration, select_linears
from .core.qlinear import QuantLinear, WeightSpec
from .core.registry import get_method, known_methods, make_config
from .eval import measure_latency, perplexity, reference_logprobs, weight_stats
from .methods.awq import AWQConfig
from .methods.dynamic import DynamicConfig
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

__all__ = [
    "quantize", "run_calibration", "select_linears", "calibration_windows", "eval_windows", "load_token_ids",
    "measure_latency", "perplexity", "reference_logprobs", "weight_stats", "load_experiment", "parse_experiment",
    "NoneConfig", "RTNConfig", "GPTQConfig", "HQQConfig", "AWQConfig", "DynamicConfig", "StaticConfig", "SmoothQuantConfig", "load_model", "model_info", "QuantLinear", "WeightSpec", "get_method",
    "known_methods", "make_config", "run_experiment", "QATConfig", "LoRAConfig", "load_quantized", "save_quantized",
]
