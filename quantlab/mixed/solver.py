"""Mixed precision under a budget: pick one candidate grid per layer from sensitivity data.

Model: each layer i gets one candidate j, costing c_ij bytes (codes + scales + zeros, exactly
what QuantLinear.storage_bytes reports) and adding s_ij to the damage, where s_ij is the KL
measured with *only* layer i quantized at j (quantlab.sensitivity). Damage is assumed
**additive** over layers (a first-order approximation: interactions between quantized layers
are ignored; the run of the chosen assignment measures the real result).

Solver: the multiple-choice knapsack  min Σ s_ij  s.t.  Σ c_ij <= budget, one j per i, solved
**exactly** by dynamic programming over cost. Costs are measured above each layer's cheapest
candidate and divided by their greatest common divisor, so the DP is exact in bytes; only when
that would exceed `max_states` cost states are costs rounded *up* to a coarser unit (the
result then stays within budget but may be slightly suboptimal; `exact` says which).

>>> plan = solve_budget(sens_rows, target_bits=4.0)        # rows from quantlab.sensitivity
>>> run = mixed_run_table("mixed-4.0b", plan)              # a [[run]] with per-layer overrides
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..core.overrides import CHANNEL


@dataclass(frozen=True)
class Plan:
    """A solved assignment: layer -> candidate config dict, with its cost and predicted damage."""

    assignment: dict[str, dict]
    total_bytes: int
    total_params: int
    predicted_kl: float
    budget_bytes: int
    exact: bool

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.total_params


def solve_mckp(costs: list[list[int]], values: list[list[float]], budget: int,
               max_states: int = 400_000) -> tuple[list[int], bool]:
    """Exact multiple-choice knapsack: (chosen index per item, exact?) minimising Σ values within budget.

    costs/values: per item, one entry per choice (integers for costs). Raises ValueError when even
    the cheapest choices exceed the budget. Ties keep the lower choice index.

    >>> solve_mckp([[1, 2], [1, 3]], [[5.0, 1.0], [4.0, 0.0]], budget=4)   # ([0, 1], True)
    """
    if not costs or any(len(c) != len(v) or not c for c, v in zip(costs, values)) or len(costs) != len(values):
        raise ValueError("costs and values need the same non-empty shape: one list of choices per item")
    low = [min(c) for c in costs]
    capacity = budget - sum(low)
    if capacity < 0:
        raise ValueError(f"budget {budget} is below the cheapest assignment ({sum(low)})")
    extra = [[cij - lo for cij in c] for c, lo in zip(costs, low)]
    unit = math.gcd(*[e for row in extra for e in row]) or 1
    exact = capacity // unit <= max_states
    if not exact:
        unit = math.ceil(capacity / max_states)
    steps = [[math.ceil(e / unit) for e in row] for row in extra]
    cap = capacity // unit
    dp = np.full(cap + 1, np.inf)  # dp[k]: least damage of the items so far at discretised extra cost exactly k
    dp[0] = 0.0
    choice = np.zeros((len(costs), cap + 1), dtype=np.uint8)
    for i, (row, vals) in enumerate(zip(steps, values)):
        new = np.full(cap + 1, np.inf)
        for j, (w, v) in enumerate(zip(row, vals)):
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = dp[: cap + 1 - w] + v
            better = cand < new
            new[better], choice[i, better] = cand[better], j
        dp = new
    k = int(np.argmin(dp))
    if not np.isfinite(dp[k]):
        raise ValueError(f"no assignment fits the budget {budget}")
    picks = []
    for i in range(len(costs) - 1, -1, -1):
        j = int(choice[i, k])
        picks.append(j)
        k -= steps[i][j]
    return picks[::-1], exact


def _table(rows: list[dict], metric: str):
    """layers (in order), candidates (in order), cost/value per (layer, candidate), params per layer."""
    layers, candidates, cost, val, params, configs = [], [], {}, {}, {}, {}
    for r in rows:
        if r.get("granularity", "layer") != "layer":
            raise ValueError(f"mixed precision needs per-layer sensitivity (granularity 'layer'), "
                             f"got {r['granularity']!r}")
        name, cand = r["unit"], r["candidate"]
        layers += [name] if name not in params else []
        candidates += [cand] if cand not in configs else []
        params[name], configs[cand] = int(r["params"]), json.loads(r["config"])
        cost[name, cand], val[name, cand] = int(r["quant_bytes"]), float(r[metric])
    missing = [(n, c) for n in layers for c in candidates if (n, c) not in cost]
    if missing:
        raise ValueError(f"sensitivity lacks {len(missing)} (layer, candidate) pairs, e.g. {missing[0]}; "
                         "measure every candidate on every layer")
    return layers, candidates, cost, val, params, configs


def achievable_bits(rows: list[dict]) -> tuple[float, float]:
    """(lowest, highest) average bits per weight the candidates can reach over the layers."""
    layers, candidates, cost, _, params, _ = _table(rows, "kl_mean")
    total = sum(params.values())
    lo = sum(min(cost[n, c] for c in candidates) for n in layers)
    hi = sum(max(cost[n, c] for c in candidates) for n in layers)
    return 8 * lo / total, 8 * hi / total


def solve_budget(rows: list[dict], target_bits: float | None = None, target_bytes: int | None = None,
                 metric: str = "kl_mean", max_states: int = 400_000) -> Plan:
    """Least summed sensitivity within an average bits-per-weight (over these layers, scales and zeros
    included) or a total-bytes budget. A budget outside the achievable range is an error naming it."""
    if (target_bits is None) == (target_bytes is None):
        raise ValueError("give exactly one of target_bits (average bits per weight) or target_bytes")
    layers, candidates, cost, val, params, configs = _table(rows, metric)
    total = sum(params.values())
    lo, hi = achievable_bits(rows)
    budget = math.floor(target_bits * total / 8) if target_bits is not None else int(target_bytes)
    asked = target_bits if target_bits is not None else 8 * budget / total
    if not lo - 1e-9 <= asked <= hi + 1e-9:
        raise ValueError(f"budget {asked:.4f} bits per weight ({budget} bytes) is outside the achievable range "
                         f"{lo:.4f}..{hi:.4f} bits per weight ({math.ceil(lo * total / 8)}..{math.floor(hi * total / 8)}"
                         f" bytes) of candidates {', '.join(candidates)}")
    picks, exact = solve_mckp([[cost[n, c] for c in candidates] for n in layers],
                              [[val[n, c] for c in candidates] for n in layers], max(budget, 0), max_states)
    chosen = {n: candidates[j] for n, j in zip(layers, picks)}
    return Plan(
        assignment={n: configs[c] for n, c in chosen.items()},
        total_bytes=sum(cost[n, c] for n, c in chosen.items()), total_params=total,
        predicted_kl=sum(val[n, c] for n, c in chosen.items()), budget_bytes=budget, exact=exact,
    )


_GRID_KEYS = ("bits", "group_size", "symmetric", "scale_dtype", "format", "double_quant")


def _grid(cfg: dict) -> tuple:
    return tuple(cfg.get(k) for k in _GRID_KEYS)


def mixed_run_table(name: str, plan: Plan) -> dict:
    """A [[run]] table: the most used candidate as the base grid, one exact-name override per other layer."""
    grids = Counter(_grid(c) for c in plan.assignment.values())
    base_grid = grids.most_common(1)[0][0]
    base = next(c for c in plan.assignment.values() if _grid(c) == base_grid)
    table = {"name": name, "method": "rtn", **{k: v for k, v in base.items() if k in _GRID_KEYS and v is not None}}
    for k, default in (("include", ["*"]), ("exclude", ["lm_head"])):  # the layers the sensitivity covered
        if base.get(k, default) != default:
            table[k] = base[k]
    overrides = []
    for layer, cfg in plan.assignment.items():
        if _grid(cfg) == base_grid:
            continue
        o = {"pattern": layer}
        for k in _GRID_KEYS:
            if cfg.get(k) != base.get(k) or k in ("bits", "group_size"):
                o[k] = CHANNEL if k == "group_size" and cfg.get(k) is None else cfg.get(k)
        o = {k: v for k, v in o.items() if v is not None}  # scale_dtype None: the format's default (TOML has no null)
        overrides.append(o)
    if overrides:
        table["overrides"] = overrides
    return table


def plan_summary(plan: Plan) -> dict:
    """Counts per candidate grid and the cost, for logs and the experiment description."""
    counts = Counter(f"w{c['bits']} {'channel' if c.get('group_size') is None else 'g' + str(c['group_size'])}"
                     for c in plan.assignment.values())
    return {"bits_per_weight": round(plan.bits_per_weight, 4), "bytes": plan.total_bytes,
            "budget_bytes": plan.budget_bytes, "predicted_kl_sum": plan.predicted_kl, "exact": plan.exact,
            "layers": dict(sorted(counts.items()))}
