"""AutoRound's compile = true (methods/autoround.py's module docstring): the block forward under torch.compile while
tuning, the check of a compiled block against its eager forward, and the preflight that torch.compile works here."""
from __future__ import annotations

import functools
import math
from contextlib import contextmanager

import torch
from torch import nn

# compile = true's check at iteration 0, compiled against eager: the loss's relative difference and each gradient's
# relative L2 difference. Measured on SmolLM2 blocks: float32 1e-7 / 5e-4, bf16 autocast 2.5e-3 / 2.5e-2 (bf16's own
# rounding, 2^-8 = 3.9e-3, moved by fusion); a miscompiled gradient (memory never written) is off by O(1).
COMPILE_TOLERANCE = {"loss": 1e-2, "grad": 0.1}


@contextmanager
def compiled_forward(block: nn.Module):
    """block.forward under torch.compile (an instance attribute; the block's own forward is back afterwards); yields
    that eager forward. Inductor rounds to the scale dtype where eager does (emulate_precision_casts): by default it
    keeps a float16 intermediate in float32, and the grid's scales would then differ from eager's in most groups."""
    import torch._inductor.config as inductor_config

    own, eager = block.__dict__.get("forward"), block.forward
    block.forward = torch.compile(eager, dynamic=False)
    try:
        with inductor_config.patch(emulate_precision_casts=True):
            yield eager
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own


def compile_disagreement(loss: float, grads: list, eager_loss: float, eager_grads: list) -> dict[str, float]:
    """compile = true's check: the loss's relative difference and the worst relative L2 difference of a gradient,
    compiled against eager (a gradient present on one side only counts as 1)."""
    worst = 0.0
    for g, e in zip(grads, eager_grads):
        if g is None and e is None:
            continue
        if g is None or e is None:
            worst = max(worst, 1.0)
            continue
        diff = float((g - e).norm() / e.norm()) if float(e.norm()) > 0 else float(g.norm() > 0)
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
    rel = abs(loss - eager_loss) / abs(eager_loss) if eager_loss else abs(loss - eager_loss)
    return {"loss": rel if math.isfinite(rel) else math.inf, "grad": worst}


@functools.cache
def check_compile(device_type: str) -> None:
    """compile = true needs torch.compile to work here (inductor: a C++ compiler on CPU, triton on CUDA): one tiny
    compiled function, before any block is tuned; raises naming the fix."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(4, device=device_type))
    except Exception as err:  # inductor raises its own types (BackendCompilerFailed, InductorError, ...)
        raise RuntimeError(f"autoround compile = true: torch.compile does not work on {device_type} here ({err}); "
                           "install a C++ compiler (CPU) or triton (CUDA), or set compile = false") from err
