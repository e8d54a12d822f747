"""A method for the Ray executor tests that kills its worker process the first time it runs (a marker file
remembers), so Ray must retry it; imported by the workers through PYTHONPATH (tests/test_ray_executor.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from quantlab.core.registry import get_method, known_methods, register_method
from quantlab.methods.rtn import RTN, RTNConfig


@dataclass(frozen=True)
class DieOnceConfig(RTNConfig):
    marker: str = ""


if "die_once" not in known_methods():
    @register_method
    class DieOnce(RTN):
        """rtn, except that the first prepare() in any process exits the process (marker file absent)."""

        name = "die_once"
        config_cls = DieOnceConfig

        def prepare(self, model, config):
            marker = Path(config.marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)  # a dead worker, not an exception
            super().prepare(model, config)

DIE_ONCE = get_method("die_once")
