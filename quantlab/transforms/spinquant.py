"""SpinQuant (Liu et al., ICLR 2025, "SpinQuant: LLM Quantization with Learned Rotations"): R1 (the residual
stream) and one R2 per layer (v_proj -> o_proj, per head) learned by Cayley SGD on the Stiefel manifold to lower the
loss of the model with its activations quantized, then folded into the weights exactly as QuaRot's Hadamards
(transforms/rotation.py), so the float model computes the same function.

As the reference (facebookresearch/SpinQuant optimize_rotation.py, train_utils/optimizer.py SGDG): R1 and R2 start
from random Hadamards, the loss is next-token cross-entropy on calibration windows, the step is SGDG's Cayley
update (momentum 0; lr 1.5 cosine-decayed over the steps, capped each step at 1 / ||W||_1), 100 steps. The
reference's step sees 8 windows of 2048 tokens (one per GPU on 8 GPUs); here a step averages the gradients of
`windows_per_step` calibration windows (default 1), taken in order and wrapping around.
The rotation is learned against activations quantized per token (the run's act_bits) with weights in float, which is
what the reference does before GPTQ (its README: "we optimize the rotation matrices with respect to a network where
only activations are quantized"); R4 (down_proj) and the o_proj Hadamard stay fixed Hadamards, as the reference's R3 /
R4. Differences: the Cayley retraction is solved exactly ((I - aW/2) Y = (I + aW/2) X) where the reference iterates
its fixed point 5 times and re-orthonormalises by QR at random (1 step in 101); the KV cache is not quantized in the
loop; weights are never quantized in the loop (the reference's w_bits < 16 setting, for RTN weights, is not ported).

Training never rotates a weight: every rotation acts on activations through hooks (the embedding's output x R1, a
reader's input x' R1ᵀ scaled by its norm's weight, a writer's output y R1, v_proj's output per head @ R2, o_proj's
input per head @ R2ᵀ), which equals the folded model exactly in float and costs a few n x n products per token.

>>> learned = learn_rotations(model, windows, RotationConfig(kind="spinquant"), act_bits=4, act_symmetric=False)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.activations import DynamicActQuant
from ..models.arch import find_blocks, rotation_facts
from .hadamard import hadamard_matrix, random_signs


@dataclass
class LearnedRotations:
    """R1 (hidden, hidden) and one R2 (head_dim, head_dim) per block, float64, x -> x R."""

    r1: torch.Tensor
    r2: list[torch.Tensor]
    loss_before: float  # mean cross-entropy over the first LOSS_WINDOWS windows, at the start (random Hadamards)
    loss_after: float  # the same, with the learned rotations
    r1_step_sizes: list[float] = field(default_factory=list)  # R1's Cayley step each step: min(lr, 1 / ||W||_1)


LOSS_WINDOWS = 8  # windows the before / after loss is measured on


def random_hadamard(n: int, seed: int) -> torch.Tensor:
    """The reference's start: diag(random +-1) H / sqrt(n) (float64)."""
    return random_signs(n, seed)[:, None] * hadamard_matrix(n).to(torch.float64) / n ** 0.5


def _skew(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The reference's skew matrix W = M - M^T, M = V X - X^T X V X / 2, V = -grad^T."""
    v = -grad.t()
    mx = v @ x
    w_hat = mx - 0.5 * (x.t() @ (x @ mx))
    return w_hat - w_hat.t()


def _capped(w: torch.Tensor, lr: float) -> float:
    """min(lr, 1 / ||W||_1), ||.||_1 the largest column sum (the reference's step cap)."""
    return min(1.0 / (float(w.abs().sum(0).max()) + 1e-8), lr)


@torch.no_grad()
def cayley_step_size(x: torch.Tensor, grad: torch.Tensor, lr: float) -> float:
    """The step cayley_step takes: min(lr, 1 / ||W||_1)."""
    return _capped(_skew(x, grad), lr)


@torch.no_grad()
def cayley_step(x: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGDG step (momentum 0) of an orthogonal x (n, n) along -grad, staying orthogonal. Pure.

    The reference's skew matrix W = M - M^T with M = V X - X^T X V X / 2, V = -grad^T; step a = min(lr, 1/||W||_1);
    the Cayley retraction Y = X + a W (X + Y) / 2 solved exactly; returns Y^T.

    >>> x = cayley_step(torch.eye(4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64), 0.1)
    """
    w = _skew(x, grad)
    alpha = _capped(w, lr)
    eye = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
    y = torch.linalg.solve(eye - 0.5 * alpha * w, (eye + 0.5 * alpha * w) @ x.t())
    return y.t()


def _per_head(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x (..., heads * d) with each head's d channels times r (d, d)."""
    return (x.reshape(*x.shape[:-1], -1, r.shape[0]) @ r).reshape(x.shape)


class _Hooks:
    """The rotated model's forward, by hooks on the float model (see the module docstring)."""

    def __init__(self, model: nn.Module, facts: dict, r1: nn.Parameter, r2: list[nn.Parameter], act: nn.Module,
                 h_o: torch.Tensor | None, h_down: torch.Tensor | None):
        self.handles, self.norms = [], {}
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        final = model.get_submodule(facts["final_norm"])
        self._fold_norm(final)
        self.handles.append(embed.register_forward_hook(lambda m, a, out: out @ r1.to(out.dtype)))
        w_final = self.norms[final]
        self.handles.append(head.register_forward_pre_hook(lambda m, a: ((a[0] @ r1.t()) * w_final,)))
        for block, r in zip(find_blocks(model), r2):
            for norm_name, consumers in facts["norm_to_linears"]:
                norm = block.get_submodule(norm_name)
                self._fold_norm(norm)
                for name in consumers:
                    self._pre(block.get_submodule(name), lambda x, w=self.norms[norm]: (act(x) @ r1.t()) * w)
            v, o, down = (block.get_submodule(facts[k]) for k in ("v", "o", "down"))
            self.handles.append(v.register_forward_hook(lambda m, a, out, r=r: _per_head(out, r)))
            self._pre(o, lambda x, r=r: _per_head(self._undo(act(self._do(x, h_o)), h_o), r.t()))
            self._pre(down, lambda x: self._undo(act(self._do(x, h_down)), h_down))
            for writer in facts["out_linears"]:
                self.handles.append(block.get_submodule(writer).register_forward_hook(lambda m, a, out: out @ r1))

    @staticmethod
    def _do(x, h):
        return x if h is None else x @ h

    @staticmethod
    def _undo(x, h):
        return x if h is None else x @ h.t()

    def _fold_norm(self, norm: nn.Module) -> None:
        """RMSNorm(x R1) = RMSNorm(x) R1 needs a weight of ones: keep it to scale the readers' inputs instead."""
        self.norms[norm] = norm.weight.detach().clone()
        norm.weight.data.fill_(1.0)

    def _pre(self, module: nn.Module, fn) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda m, a: (fn(a[0]),) + tuple(a[1:])))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for norm, weight in self.norms.items():
            norm.weight.data.copy_(weight)


@contextlib.contextmanager
def _rotated(model: nn.Module, config, act_bits: int, act_symmetric: bool):
    """The model run with R1 / R2 (random Hadamards from config.seed, as float32 parameters) applied by hooks and its
    activations fake-quantized per token, its own parameters frozen; yields (parameters [R1, *R2], their float64
    masters). Everything is restored on exit (hooks removed, norms, requires_grad, training mode)."""
    facts = rotation_facts(model)
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    device = next(model.parameters()).device
    r1 = nn.Parameter(random_hadamard(cfg.hidden_size, config.seed).float().to(device))
    r2 = [nn.Parameter(random_hadamard(head_dim, config.seed + 1).float().to(device))
          for _ in range(len(find_blocks(model)))]
    dense = lambda n: (hadamard_matrix(n).to(torch.float32) / n ** 0.5).to(device)  # noqa: E731
    h_o = dense(heads * head_dim) if config.o_proj_hadamard else None
    h_down = dense(cfg.intermediate_size) if config.r4 else None
    act = DynamicActQuant(act_bits, act_symmetric)
    requires = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    masters = [r1.detach().double(), *(r.detach().double() for r in r2)]  # float64 iterates, float32 forward
    hooks = _Hooks(model, facts, r1, r2, act, h_o, h_down)
    was_training = model.training
    model.eval()
    try:
        yield [r1, *r2], masters
    finally:
        hooks.remove()
        for p, flag in requires.items():
            p.requires_grad_(flag)
        model.train(was_training)


def _gradients(model: nn.Module, params: list[nn.Parameter], windows: list[torch.Tensor], device) -> list:
    """The gradient of the mean cross-entropy of `windows` for each parameter: one backward per window."""
    grads = None
    for w in windows:
        with torch.enable_grad():
            loss = _loss(model, w.to(device)) / len(windows)
            g = torch.autograd.grad(loss, params)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return grads


def learn_rotations(model: nn.Module, windows: list[torch.Tensor], config, act_bits: int, act_symmetric: bool,
                    progress: bool = True) -> LearnedRotations:
    """R1 and the R2s of `model` (float, unchanged on return) by config.steps Cayley SGD steps, each on the mean
    cross-entropy of config.windows_per_step calibration windows (1, T) in order (wrapping around), the
    activations fake-quantized per token at act_bits (straight-through)."""
    device = next(model.parameters()).device
    with _rotated(model, config, act_bits, act_symmetric) as (params, masters):
        before = _mean_loss(model, windows[:LOSS_WINDOWS], device)
        k, steps = config.windows_per_step, []
        for step in tqdm(range(config.steps), desc="spinquant", leave=False, disable=not progress):
            grads = _gradients(model, params, [windows[(step * k + j) % len(windows)] for j in range(k)], device)
            lr = config.lr * 0.5 * (1 + math.cos(math.pi * step / config.steps))  # cosine, no warm-up (HF Trainer)
            steps.append(cayley_step_size(masters[0], grads[0].double(), lr))
            with torch.no_grad():
                for i, (p, g) in enumerate(zip(params, grads)):
                    masters[i] = cayley_step(masters[i], g.double(), lr)
                    p.copy_(masters[i].to(p.dtype))
        after = _mean_loss(model, windows[:LOSS_WINDOWS], device)
    return LearnedRotations(masters[0].cpu(), [m.cpu() for m in masters[1:]], before, after, steps)


def loss_along_first_step(model: nn.Module, windows: list[torch.Tensor], config, act_bits: int, act_symmetric: bool,
                          sizes, held_out: int = LOSS_WINDOWS) -> list[dict]:
    """A diagnostic of the loss surface learn_rotations descends: from the start (random Hadamards), the first step's
    gradient on config.windows_per_step windows, then for each step size t in `sizes` (0: the start) the Cayley step
    of size min(t, cap) applied to every rotation and the loss measured on those windows (`grad_loss`) and on the next
    `held_out` windows (`held_out_loss`). A smooth surface lowers grad_loss for small t; the model is unchanged."""
    device = next(model.parameters()).device
    k = config.windows_per_step
    grad_windows, other = windows[:k], windows[k:k + held_out]
    rows = []
    with _rotated(model, config, act_bits, act_symmetric) as (params, masters):
        grads = _gradients(model, params, grad_windows, device)
        for t in sizes:
            with torch.no_grad():
                for p, m, g in zip(params, masters, grads):
                    p.copy_((cayley_step(m, g.double(), t) if t > 0 else m).to(p.dtype))
            rows.append({"t": float(t), "step": cayley_step_size(masters[0], grads[0].double(), t) if t > 0 else 0.0,
                         "grad_loss": _mean_loss(model, grad_windows, device),
                         "held_out_loss": _mean_loss(model, other, device)})
    return rows


def loss_under_perturbation(model: nn.Module, windows: list[torch.Tensor], config, act_bits: int,
                            act_symmetric: bool, sizes, draws: int = 4, seed: int = 0) -> list[dict]:
    """A diagnostic of the loss surface's noise: from the start (random Hadamards), R1 times a random rotation
    exp(eps A), A skew with entries of about 1 / sqrt(n) (so eps is the relative size of the change), `draws` times
    per eps in `sizes`, and the mean loss of `windows` each time (eps 0: the start, once). Where a change of 1e-6
    moves the loss as much as one of 1e-2 does, the loss the optimiser sees has a noise floor at that level (the
    activations' rounding flipping), and a short run's before / after difference is within it. Model unchanged."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with _rotated(model, config, act_bits, act_symmetric) as (params, masters):
        n = masters[0].shape[0]
        rows.append({"eps": 0.0, "draw": 0, "loss": _mean_loss(model, windows, device)})
        for eps in sizes:
            for draw in range(draws):
                a = torch.randn(n, n, generator=gen, dtype=torch.float64)
                a = (a - a.t()) / (a - a.t()).norm() * n ** 0.5
                with torch.no_grad():
                    params[0].copy_((masters[0] @ torch.linalg.matrix_exp(eps * a.to(masters[0].device))).float())
                rows.append({"eps": float(eps), "draw": draw, "loss": _mean_loss(model, windows, device)})
        with torch.no_grad():
            params[0].copy_(masters[0].float())
    return rows


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one window (1, T)."""
    logits = model(ids).logits[:, :-1].float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def _mean_loss(model: nn.Module, windows: list[torch.Tensor], device) -> float:
    return sum(float(_loss(model, w.to(device))) for w in windows) / max(len(windows), 1)
