"""Observers attached to modules: each module's input fed to an observer by a forward pre-hook.

    observers, remove = attach_input_observers({"q": block.self_attn.q_proj}, lambda name: HessianObserver())
    run the forwards; then observers["q"].compute(); remove()
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from .observers import Observer


def attach_input_observers(modules: dict[str, nn.Module], factory: Callable[[str], Observer]):
    """Observe each module's input with a fresh observer; returns (observers by name, remove())."""
    observers = {name: factory(name) for name in modules}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: observers[name].update(args[0]))
        for name, m in modules.items()
    ]

    def remove():
        for h in handles:
            h.remove()

    return observers, remove


def attach_shared_input_observers(modules: dict[str, nn.Module], factory: Callable[[str], Observer]):
    """attach_input_observers, but modules handed the very same input tensor share one observer, which sees it once
    (GPTQ's q/k/v read the input norm's output, gate/up the second norm's: one Hessian each, not three and two).

    Who shares is decided on the first forward (a module whose input is the tensor object an earlier module of the
    same forward was handed joins that module's observer) and checked on every later one; a forward where it no
    longer holds raises rather than give a shared observer the wrong count. A forward starts again when a module is
    called a second time. Returns (observers by name, aliases included; remove())."""
    owner_of: dict[str, str] = {}
    observers: dict[str, Observer] = {}
    handed: dict[int, tuple[torch.Tensor, str, int]] = {}  # this forward's inputs: id -> (tensor, owner, version)
    called: set[str] = set()

    def hook(name: str, x: torch.Tensor) -> None:
        if name in called:  # a new forward
            handed.clear()
            called.clear()
        called.add(name)
        seen = handed.get(id(x))
        sibling = seen[1] if seen is not None and seen[0] is x and seen[2] == x._version else None
        if name not in owner_of:
            owner_of[name] = sibling or name
            if sibling is None:
                observers[name] = factory(name)
        elif owner_of[name] != name and sibling != owner_of[name]:
            raise RuntimeError(f"{name}: its input is no longer the tensor {owner_of[name]} is handed, so the two "
                               f"cannot share an observer; observe them apart (attach_input_observers)")
        if owner_of[name] == name:
            observers[name].update(x)
            handed[id(x)] = (x, name, x._version)

    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: hook(name, args[0]))
               for name, m in modules.items()]

    class Shared(Mapping):  # filled as the forwards run: each name resolves to its owner's observer
        def __getitem__(self, name: str) -> Observer:
            if name not in modules:
                raise KeyError(name)
            if name not in owner_of:
                raise ValueError(f"{name}: no observed forward reached it, so its observer saw no data")
            return observers[owner_of[name]]

        def __iter__(self):
            return iter(modules)

        def __len__(self) -> int:
            return len(modules)

    def remove():
        for h in handles:
            h.remove()
        handed.clear()

    return Shared(), remove
