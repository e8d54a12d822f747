"""Mixed-precision solver: exact vs brute force, within budget, clear range errors, runnable output."""
import itertools
import json
import math
import random

import pytest

from quantlab import make_config
from quantlab.mixed.solver import achievable_bits, mixed_run_table, solve_budget, solve_mckp


def _brute_force(costs, values, budget):
    best = None
    for picks in itertools.product(*[range(len(c)) for c in costs]):
        cost = sum(c[j] for c, j in zip(costs, picks))
        if cost <= budget:
            value = sum(v[j] for v, j in zip(values, picks))
            best = value if best is None or value < best else best
    return best


def test_hand_checked_instance():
    # 3 layers x (int3, int4, int8): costs in bytes, damage in KL. Budget 13.
    costs = [[3, 4, 8], [3, 4, 8], [6, 8, 16]]
    values = [[0.5, 0.1, 0.0], [0.2, 0.15, 0.0], [0.9, 0.3, 0.01]]
    # cheapest is 12; the one spare byte buys one int3 -> int4 step: best on layer 0 (gain 0.4),
    # not layer 1 (0.05); layer 2's step costs 2.
    picks, exact = solve_mckp(costs, values, 13)
    assert picks == [1, 0, 0] and exact
    # budget 16: +4 over the cheapest: layer 0 -> int4 (+1), layer 2 -> int4 (+2), layer 1 -> int4 (+1)
    assert solve_mckp(costs, values, 16)[0] == [1, 1, 1]
    assert solve_mckp(costs, values, 32)[0] == [2, 2, 2]


@pytest.mark.parametrize("seed", range(12))
def test_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n, k = rng.randint(2, 6), rng.randint(2, 3)
    costs = [sorted(rng.randint(1, 40) * 8 for _ in range(k)) for _ in range(n)]
    values = [sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(n)]
    lo, hi = sum(c[0] for c in costs), sum(c[-1] for c in costs)
    for budget in (lo, (lo + hi) // 2, rng.randint(lo, hi), hi):
        picks, exact = solve_mckp(costs, values, budget)
        assert exact
        assert sum(c[j] for c, j in zip(costs, picks)) <= budget
        assert sum(v[j] for v, j in zip(values, picks)) == pytest.approx(_brute_force(costs, values, budget), abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_coarse_cost_unit_stays_within_budget_and_near_optimal(seed):
    """Costs rounded up to a unit u (capacity / max_states): the plan fits the true budget, and is at least
    as good as the brute-force optimum with n·u less budget (any such assignment fits the rounded problem)."""
    rng = random.Random(seed)
    costs = [sorted(rng.randint(1000, 90000) for _ in range(3)) for _ in range(8)]
    values = [sorted((rng.random() for _ in range(3)), reverse=True) for _ in range(8)]
    budget = sum(c[1] for c in costs)
    picks, exact = solve_mckp(costs, values, budget, max_states=50)
    assert not exact and sum(c[j] for c, j in zip(costs, picks)) <= budget
    unit = math.ceil((budget - sum(c[0] for c in costs)) / 50)
    got = sum(v[j] for v, j in zip(values, picks))
    assert got <= _brute_force(costs, values, budget - len(costs) * unit) + 1e-12


def test_budget_below_cheapest_fails():
    with pytest.raises(ValueError, match="budget 5 is below the cheapest assignment"):
        solve_mckp([[3, 4], [3, 4]], [[1, 0], [1, 0]], 5)


CANDIDATES = [{"method": "rtn", "bits": b, "group_size": g, "symmetric": False} for b, g in ((3, 64), (4, 64), (8, None))]


def _rows():
    """Sensitivity-like rows for 4 layers of 32 x 128 weights; costs follow the real byte formula."""
    rows = []
    for i, (name, scale) in enumerate([("l.0.q", 1.0), ("l.0.down", 20.0), ("l.1.q", 0.5), ("l.1.down", 5.0)]):
        for cfg in CANDIDATES:
            cfg = make_config(cfg)
            groups = 32 * (1 if cfg.group_size is None else 128 // cfg.group_size)
            nbytes = 4096 * cfg.bits // 8 + 3 * groups
            rows.append({"unit": name, "granularity": "layer", "params": 4096, "candidate": f"w{cfg.bits}",
                         "quant_bytes": nbytes, "kl_mean": scale * 2.0 ** (-2 * cfg.bits),
                         "config": json.dumps({"method": "rtn", "bits": cfg.bits, "group_size": cfg.group_size,
                                               "symmetric": False})})
    return rows


def test_solve_budget_in_bits_is_within_budget_and_runnable():
    rows = _rows()
    lo, hi = achievable_bits(rows)
    assert lo == pytest.approx(3 + 24 / 64) and hi == pytest.approx(8 + 3 * 32 * 8 / 4096)
    plan = solve_budget(rows, target_bits=4.0)
    assert plan.bits_per_weight <= 4.0 and plan.exact
    # brute force over the 3^4 assignments with the same additive model
    by = {(r["unit"], r["candidate"]): r for r in rows}
    names, cands = ["l.0.q", "l.0.down", "l.1.q", "l.1.down"], ["w3", "w4", "w8"]
    best = _brute_force([[by[n, c]["quant_bytes"] for c in cands] for n in names],
                        [[by[n, c]["kl_mean"] for c in cands] for n in names], plan.budget_bytes)
    assert plan.predicted_kl == pytest.approx(best, rel=1e-12)
    assert plan.assignment["l.0.down"]["bits"] > 3  # the most sensitive layer gets more bits
    table = mixed_run_table("mixed-4b", plan)
    table.pop("name")
    cfg = make_config(table)
    for name, chosen in plan.assignment.items():
        spec = cfg.spec_for(name)
        assert (spec.bits, spec.group_size, spec.symmetric) == (chosen["bits"], chosen["group_size"], False)


@pytest.mark.parametrize("target", [3.0, 8.5])
def test_budget_outside_range_names_the_range(target):
    with pytest.raises(ValueError, match=rf"budget {target:.4f} bits per weight .* outside the achievable range "
                                         r"3.3750..8.1875 bits per weight"):
        solve_budget(_rows(), target_bits=target)


def test_missing_candidate_for_a_layer_fails():
    rows = _rows()[:-1]
    with pytest.raises(ValueError, match=r"lacks 1 \(layer, candidate\) pairs, e.g. \('l.1.down', 'w8'\)"):
        solve_budget(rows, target_bits=4.0)


def test_formats_are_mixed_precision_candidates_and_the_run_table_is_toml():
    """Candidates over number formats (as sensitivity rows store them: config_to_dict, scale_dtype None) give
    overrides naming each layer's format, with no null the TOML writer could not store."""
    import tomlkit

    from quantlab.core.qlinear import QuantLinear
    from quantlab.core.registry import config_to_dict

    candidates = [make_config({"method": "rtn", "format": f}) for f in ("mxfp4", "nf4", "fp8_e4m3")]
    rows = []
    for name, scale in [("l.0.q", 1.0), ("l.0.down", 20.0), ("l.1.q", 0.5), ("l.1.down", 5.0)]:
        for cfg in candidates:
            spec = cfg.weight_spec
            rows.append({"unit": name, "granularity": "layer", "params": 4096, "candidate": spec.describe(),
                         "quant_bytes": QuantLinear(128, 32, False, spec).storage_bytes(),
                         "kl_mean": scale * 2.0 ** (-2 * spec.bits), "config": json.dumps(config_to_dict(cfg))})
    plan = solve_budget(rows, target_bits=5.5)
    assert plan.assignment["l.0.down"]["format"] == "fp8_e4m3"  # the sensitive layer gets FP8
    table = mixed_run_table("mixed-5b", plan)
    tomlkit.dumps({"run": [table]})  # raises on a None anywhere
    table.pop("name")
    cfg = make_config(table)
    for name, chosen in plan.assignment.items():
        assert cfg.spec_for(name).format == chosen["format"]
