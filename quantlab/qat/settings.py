"""TrainSettings: the frozen, validated knobs of the QAT training loop (quantlab/qat/train.py)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..util.checks import check_dtype, check_int


def _check_float(name: str, value, lo: float, strict: bool = True) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= lo if strict else value < lo):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {lo:g}, got {value!r}")


@dataclass(frozen=True)
class TrainSettings:
    """AdamW with linear warm-up then cosine decay; loss = ce_weight * CE + kd_weight * KL(teacher || student).

    steps: optimizer steps; each sees batch_size * grad_accum windows of seq_len tokens.
    lr: quantized-layer weights; scale_lr: learned scales / zero points (LSQ).
    dtype: torch.autocast dtype for the forward ("float32" = no autocast; "float16" needs CUDA, with GradScaler).
    checkpoint_every: save a resumable checkpoint every N steps (0 = never; needs a checkpoint dir).
    """

    steps: int = 32
    batch_size: int = 1
    seq_len: int = 512
    lr: float = 1e-5
    scale_lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    grad_accum: int = 1
    ce_weight: float = 0.0
    kd_weight: float = 1.0
    kd_temperature: float = 1.0
    dtype: str = "float32"
    checkpoint_every: int = 0
    seed: int = 0

    def __post_init__(self):
        check_int("steps", self.steps, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("seq_len", self.seq_len, 2)
        check_int("grad_accum", self.grad_accum, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("checkpoint_every", self.checkpoint_every, 0)
        check_int("seed", self.seed, 0)
        _check_float("lr", self.lr, 0.0)
        _check_float("scale_lr", self.scale_lr, 0.0)
        _check_float("kd_temperature", self.kd_temperature, 0.0)
        for name in ("weight_decay", "grad_clip", "ce_weight", "kd_weight"):
            _check_float(name, getattr(self, name), 0.0, strict=False)
        _check_float("min_lr_ratio", self.min_lr_ratio, 0.0, strict=False)
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.ce_weight == 0 and self.kd_weight == 0:
            raise ValueError("ce_weight and kd_weight are both 0: the loss would be 0; set at least one > 0")
        check_dtype("training dtype", self.dtype)

    @property
    def windows_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    @property
    def needs_teacher(self) -> bool:
        return self.kd_weight > 0

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, then cosine."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(self.steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)
