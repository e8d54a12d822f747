"""`rotation = {...}`: rotate the float model before the method quantizes it (QuaRot; transforms/rotation.py).

The method calibrates on the rotated model, so GPTQ Hessians and static ranges see rotated activations. R4, the
o_proj Hadamard (and scope "online") leave a Hadamard running in PyTorch before each down_proj / o_proj (every linear), which real kernels do not
run, and which a per-channel scale folded across that pair (the method's capability folds_scales_across_mlp, or any
folded scale for "online") would not survive.
"""
from __future__ import annotations

import contextlib
import time

from ..core.extras import BEFORE_QUANTIZE, RunExtra, register_extra
from ..core.registry import get_method, nested_configs
from ..transforms.rotation import RotationConfig, check_rotatable, rotate_model
from ..transforms.spinquant import learn_rotations


@register_extra
class Rotation(RunExtra):
    key = "rotation"
    config_cls = RotationConfig
    stage = BEFORE_QUANTIZE

    def refusal(self, config: RotationConfig, backend: str) -> str | None:
        if backend in ("onnxruntime", "llama.cpp"):
            return "does not export a rotation (rotation = {...})"
        if config.online_hadamards and backend != "simulated":
            return ("does not run the online Hadamard of a rotation with r4 = true, o_proj_hadamard = true or scope "
                    "'online' (a PyTorch hook before the layer; set r4 = false and o_proj_hadamard = false for a "
                    "residual rotation folded into the weights)")
        return None

    def needs_calibration_for(self, config: RotationConfig) -> bool:
        return config.kind == "spinquant"

    def check(self, config: RotationConfig, method_config, backend: str) -> None:
        if config.kind == "spinquant" and _act_quant(method_config) is None:
            raise ValueError(f"rotation kind 'spinquant' learns its rotations against the run's activation "
                             f"quantization; method {get_method(method_config).name!r} quantizes no activations "
                             f"(use dynamic, e.g. W4A4: method = \"dynamic\", act_bits = 4)")
        for c in nested_configs(method_config):
            method = get_method(c)
            if config.scope == "online" and method.folds_channel_scales(c):
                raise ValueError(f"rotation scope 'online' (a Hadamard on every linear's input) does not compose "
                                 f"with {method.name}: its per-channel scales live in the unrotated channels")
            if config.scope == "residual" and config.o_proj_hadamard and method.folds_scales_between_linears(c):
                raise ValueError(f"rotation with o_proj_hadamard = true (online Hadamard on o_proj's input) does not "
                                 f"compose with {method.name}: a scale it folds into v_proj -> o_proj would not cancel "
                                 f"through the Hadamard; set o_proj_hadamard = false in rotation")
            if config.r4 and method.folds_scales_across_mlp(c):
                raise ValueError(f"rotation with r4 = true (online Hadamard on down_proj's input) does not compose "
                                 f"with {method.name}: its up_proj -> down_proj scales "
                                 f"would not cancel through the Hadamard; set r4 = false in rotation")

    def parse_stored(self, table: dict) -> RotationConfig:
        """Rows stored before o_proj_hadamard existed (residual scope, no such key) ran without it."""
        if table.get("scope", "residual") == "residual" and "o_proj_hadamard" not in table:
            table = {**table, "o_proj_hadamard": False}
        return self.parse(table)

    def check_model_config(self, config: RotationConfig, model_config) -> None:
        if config.scope != "online":  # online: a Hadamard on every linear's input, any model
            check_rotatable(config, model_config)

    @contextlib.contextmanager
    def apply(self, model, config: RotationConfig, calibration=None, method_config=None):
        t0 = time.perf_counter()
        learned, row = None, {}
        if config.kind == "spinquant":
            bits, symmetric = _act_quant(method_config)
            learned = learn_rotations(model, calibration, config, bits, symmetric)
            row = {"spinquant_loss_before": learned.loss_before, "spinquant_loss_after": learned.loss_after,
                   "spinquant_act_bits": bits,  # R1's mean Cayley step: lr unless the 1 / ||W||_1 cap binds
                   "spinquant_r1_step_mean": sum(learned.r1_step_sizes) / max(len(learned.r1_step_sizes), 1)}
        facts = rotate_model(model, config, learned)  # weights: stays (the run's model is a copy)
        yield facts | row | {"rotate_s": time.perf_counter() - t0}


def _act_quant(method_config) -> tuple[int, bool] | None:
    """(act_bits, symmetric) of the run's activation quantization, None where activations stay float."""
    bits = get_method(method_config).act_bits_for(method_config)
    if bits is None:
        return None
    holder = next((c for c in nested_configs(method_config) if getattr(c, "act_bits", None) == bits), method_config)
    return bits, bool(getattr(holder, "act_symmetric", True))
