"""The all-pairs leaderboard: Holm against worked values, letters on textbook cases and a property test, windows
for power against a hand value and a simulation, synthetic rows with known differences, the CLI end to end, and
a committed report read back consistently."""
import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from quantlab.cli import main
from quantlab.reporting.leaderboard import (calibration_noise, holm, leaderboard, leaderboard_markdown, letters,
                                            load_rows, pairwise, paired_t_pvalue, windows_for_power)

TOK = 511  # predicted tokens per window of seq_len 512
N_WINDOWS = 40


def _row(run: str, per_token_nll: np.ndarray, **extra) -> dict:
    """A report row as the CSV stores it: per-window NLL sums and token counts as JSON text."""
    nll = per_token_nll * TOK
    return {"run": run, "ppl": math.exp(nll.sum() / (TOK * nll.size)), "window_nll": json.dumps(nll.tolist()),
            "window_tokens": json.dumps([TOK] * nll.size), "eval_windows": nll.size, "seq_len": 512, **extra}


@pytest.fixture()
def synthetic_rows() -> list[dict]:
    """A; B 5% worse on every window (+ln 1.05 nats/token) with small noise; C equal to A with small noise."""
    rng = np.random.default_rng(0)
    base = rng.normal(3.5, 0.3, N_WINDOWS)  # per-token NLL of each window: windows differ a lot in difficulty
    return [_row("A", base), _row("B", base + math.log(1.05) + rng.normal(0, 0.002, N_WINDOWS)),
            _row("C", base + rng.normal(0, 0.002, N_WINDOWS))]


# ---- Holm ----

def test_holm_matches_the_worked_example():
    """p = (0.01, 0.04, 0.03, 0.005), M = 4: sorted 0.005, 0.01, 0.03, 0.04 scale to 4·0.005 = 0.02, 3·0.01 = 0.03,
    2·0.03 = 0.06, 1·0.04 = 0.04; the running maximum makes the last 0.06. Exact up to float rounding."""
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02], rtol=1e-12, atol=0)


@pytest.mark.parametrize("p, expected", [
    ([0.5, 0.6], [1.0, 1.0]),  # 2·0.5 caps at 1, and 0.6 is lifted to the running maximum
    ([0.02, 0.02, 0.02], [0.06, 0.06, 0.06]),  # ties: 3·0.02, then max(0.06, 2·0.02), max(0.06, 0.02)
    ([0.001], [0.001]),  # one test: nothing to adjust
    ([0.04, 0.001, 0.2], [0.08, 0.003, 0.2]),  # 3·0.001, 2·0.04, 1·0.2
])
def test_holm_hand_values(p, expected):
    np.testing.assert_allclose(holm(p), expected, rtol=1e-12, atol=0)


def test_holm_refuses_values_that_are_not_p_values():
    with pytest.raises(ValueError, match="p-values in"):
        holm([0.1, 1.5])


# ---- letters ----

@pytest.mark.parametrize("order, significant, expected", [
    ("ABC", [("A", "B"), ("A", "C"), ("B", "C")], {"A": "a", "B": "b", "C": "c"}),  # all different
    ("ABC", [], {"A": "a", "B": "a", "C": "a"}),  # none different
    ("ABC", [("A", "C")], {"A": "a", "B": "ab", "C": "b"}),  # the chain A~B, B~C, A≠C
    ("ABC", [("A", "B")], {"A": "a", "B": "b", "C": "ab"}),  # C ranked last, yet like both
    # four, not transitive: A~B, B~C, C~D; A≠C, A≠D, B≠D (Piepho 2004's staircase)
    ("ABCD", [("A", "C"), ("A", "D"), ("B", "D")], {"A": "a", "B": "ab", "C": "bc", "D": "c"}),
    # four, one difference in the middle: B≠C only; A and D go with both sides
    ("ABCD", [("C", "B")], {"A": "ab", "B": "a", "C": "b", "D": "ab"}),
])
def test_letters_textbook_cases(order, significant, expected):
    assert letters(list(order), significant) == expected


def test_letters_property_shared_letter_iff_not_significant():
    """Random significance matrices (2..8 candidates, densities 0..1): two candidates share a letter exactly when
    their pair is not significant; every candidate has a letter; the best has 'a'; no letter's set lies inside
    another's (absorbed)."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(2, 9))
        names = [f"r{i}" for i in range(n)]
        sig = {pair for pair in itertools.combinations(names, 2) if rng.random() < rng.random()}
        shown = letters(names, sig)
        for a, b in itertools.combinations(names, 2):
            assert bool(set(shown[a]) & set(shown[b])) == ((a, b) not in sig), (names, sig, shown)
        assert all(shown.values()) and "a" in shown[names[0]]
        sets = [{x for x in names if ch in shown[x]} for ch in sorted(set("".join(shown.values())))]
        assert not any(s < t for s in sets for t in sets), shown


def test_letters_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown 'Z'; known: A, B"):
        letters(["A", "B"], [("A", "Z")])


# ---- windows for power ----

def _standardized(n: int, mean: float, sd: float) -> np.ndarray:
    z = np.random.default_rng(3).normal(size=n)
    return mean + sd * (z - z.mean()) / z.std(ddof=1)  # exactly this mean and sample sd


def test_windows_for_power_hand_value():
    """mean 0.01, sd 0.02: ((1.959964 + 0.841621) · 0.02 / 0.01)² = 5.603170² = 31.3955 → 32 windows."""
    assert windows_for_power(_standardized(16, 0.01, 0.02)) == 32
    # alpha 0.01, power 0.9: ((2.575829 + 1.281552) · 2)² = 59.52 → 60
    assert windows_for_power(_standardized(16, -0.01, 0.02), alpha=0.01, power=0.9) == 60


def test_windows_for_power_edges():
    assert windows_for_power([0.1, -0.1, 0.0]) is None  # mean exactly 0: no n resolves it
    assert windows_for_power([0.2, 0.2, 0.2]) == 2  # no spread: the formula's 0, lifted to a t-test's minimum
    with pytest.raises(ValueError, match="alpha and power"):
        windows_for_power([0.1, 0.2], power=1.0)


def test_windows_for_power_simulated():
    """At the computed n (32 for effect size mean/sd = 0.5), a paired t-test on simulated differences rejects in
    ≈80% of 4000 draws. References: the exact noncentral-t power at that n (0.782: the normal approximation
    slightly overstates power), within 0.02 (3 standard errors of a 4000-draw proportion); and 0.8 within 0.04."""
    n = windows_for_power(_standardized(16, 0.5, 1.0))
    assert n == 32
    d = np.random.default_rng(7).normal(0.5, 1.0, size=(4000, n))
    rejected = float((sps.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean())
    crit, noncentral = sps.t.ppf(0.975, n - 1), 0.5 * math.sqrt(n)
    exact = sps.nct.sf(crit, n - 1, noncentral) + sps.nct.cdf(-crit, n - 1, noncentral)
    assert abs(rejected - exact) < 0.02 and abs(rejected - 0.8) < 0.04, (rejected, exact)


# ---- pairs and the leaderboard on synthetic rows ----

def test_paired_t_pvalue_matches_scipy_ttest_rel():
    """Reference: scipy.stats.ttest_rel on the same per-window values, to 1e-12 relative."""
    rng = np.random.default_rng(4)
    a, b = rng.normal(3.5, 0.3, 20), rng.normal(3.52, 0.3, 20)
    assert paired_t_pvalue(b - a) == pytest.approx(sps.ttest_rel(b, a).pvalue, rel=1e-12)
    assert paired_t_pvalue([0.0, 0.0]) == 1.0 and paired_t_pvalue([0.1, 0.1]) == 0.0  # no spread


def test_pairwise_on_known_differences(synthetic_rows):
    pairs = pairwise(synthetic_rows).set_index(["a", "b"])
    first, second = pairs.attrs["order"][:2]
    assert {first, second} == {"A", "C"} and pairs.attrs["order"][2] == "B"
    ab = pairs.loc[(first, "B")]
    nll = {r["run"]: np.array(json.loads(r["window_nll"])) for r in synthetic_rows}
    exact = (math.exp((nll["B"].sum() - nll[first].sum()) / (TOK * N_WINDOWS)) - 1) * 100  # the point estimate
    assert ab["delta_pct"] == pytest.approx(exact, rel=1e-12)
    assert ab["delta_pct"] == pytest.approx(5.0, abs=0.1)  # built 5% worse, noise sd 0.002 nats/token
    assert ab["ci_low"] < ab["delta_pct"] < ab["ci_high"] and ab["ci_low"] > 4.5
    d = (nll["B"] - nll[first]) / TOK
    assert ab["p"] == pytest.approx(sps.ttest_rel(nll["B"] / TOK, nll[first] / TOK).pvalue, rel=1e-9)
    assert ab["d_mean"] == pytest.approx(d.mean(), rel=1e-12) and ab["significant"]
    assert not pairs.loc[(first, second), "significant"]  # C is A plus zero-mean noise
    np.testing.assert_allclose(pairs["p_holm"], holm(pairs["p"]), rtol=0, atol=0)


def test_leaderboard_letters_for_known_differences(synthetic_rows):
    table, pairs = leaderboard(synthetic_rows)
    assert list(table["run"][:2]) in (["A", "C"], ["C", "A"]) and table["run"].iloc[2] == "B"
    assert dict(zip(table["run"], table["letters"])) == {"A": "a", "C": "a", "B": "b"}
    assert list(table["rank"]) == [1, 2, 3] and table["delta_pct"].isna().iloc[0]
    assert table["windows_needed"].iloc[2] == 2  # a 5% gap with 0.2% noise: the minimum
    assert not pairs["within_noise"].any()  # no seeds here


def test_calibration_noise_marks_a_significant_gap_within_noise():
    """D was calibrated twice (4% and 6% worse than A, every window); E is 5% worse. The window test separates
    every pair, but E vs either D (≈1% apart) and D-seed0 vs D-seed1 (its own spread) lie within D's spread of ≈2%
    of A's ppl; A, 4% away, stays resolved."""
    rng = np.random.default_rng(5)
    base = rng.normal(3.5, 0.3, N_WINDOWS)

    def noisy(pct):
        return base + math.log(1 + pct / 100) + rng.normal(0, 0.001, N_WINDOWS)

    rows = [_row("A", base), _row("D-seed0", noisy(4), seed=0, run_group="D"),
            _row("D-seed1", noisy(6), seed=1, run_group="D"), _row("E", noisy(5), seed=0, run_group="E")]
    noise = calibration_noise(rows)
    assert list(noise["group"]) == ["D"] and noise["draws"].iloc[0] == 2
    assert noise["ppl_spread"].iloc[0] == pytest.approx(rows[2]["ppl"] - rows[1]["ppl"], rel=1e-12)
    table, pairs = leaderboard(rows)
    assert pairs["significant"].all()
    within = {(a, b) for a, b, w in zip(pairs["a"], pairs["b"], pairs["within_noise"]) if w}
    assert within == {("D-seed0", "E"), ("D-seed0", "D-seed1"), ("E", "D-seed1")}
    assert dict(zip(table["run"], table["letters"])) == {"A": "a", "D-seed0": "b", "E": "b", "D-seed1": "b"}
    assert list(table["within_noise"][1:]) == [False, True, True]  # against the run above: A, D-seed0, E
    text = leaderboard_markdown(table, pairs)
    assert "3 more pass the window test but lie within calibration noise" in text
    assert "Not resolved from the run above: E (Δ" in text and "%, within calibration noise); D-seed1 (Δ" in text


def test_calibration_noise_finds_draws_by_suffix_and_by_seed_column():
    """Names differing only in -seed<N> (no run_group), and one run name rerun with another seed (the latest row of
    each run and seed counts)."""
    rows = pd.DataFrame({"run": ["g-seed0", "g-seed1", "g-seed2", "h", "h", "h", "solo"],
                         "seed": [np.nan, np.nan, np.nan, 0, 1, 1, 0],
                         "ppl": [10.0, 12.5, 11.0, 20.0, 21.0, 23.0, 5.0]})
    noise = calibration_noise(rows).set_index("group")
    assert noise.loc["g", "ppl_spread"] == 2.5 and noise.loc["g", "draws"] == 3
    assert noise.loc["h", "ppl_spread"] == 3.0 and noise.loc["h", "runs"] == ["h"]  # seed 1's latest row: 23
    assert "solo" not in noise.index


def test_runs_on_different_windows_are_refused(synthetic_rows):
    rows = [dict(r) for r in synthetic_rows]
    rows[2]["eval_windows"] = 80
    with pytest.raises(ValueError, match=r"different windows.*eval_windows: 40 \(A, B\); 80 \(C\)"):
        pairwise(rows)
    rows = [dict(r) for r in synthetic_rows]
    rows[1]["window_tokens"] = json.dumps([TOK - 1] * N_WINDOWS)  # same protocol columns, other windows
    with pytest.raises(ValueError, match="runs B predicted other tokens per window"):
        pairwise(rows)


def test_rows_without_windows_are_left_out_and_named(synthetic_rows):
    rows = synthetic_rows + [{"run": "failed", "ppl": float("nan")}]
    table, pairs = leaderboard(rows)
    assert "failed" not in set(table["run"])
    assert "Left out (no per-window data): failed." in leaderboard_markdown(table, pairs)


# ---- files and the CLI ----

def test_a_report_without_window_data_names_the_file_and_columns(tmp_path):
    path = tmp_path / "embed.csv"
    pd.DataFrame({"run": ["a", "b"], "cos_mean": [0.9, 0.8]}).to_csv(path, index=False)
    with pytest.raises(ValueError, match=rf"{path}: no per-window data \(missing column\(s\) window_nll, "
                                         "window_tokens\\)"):
        load_rows(path)


def test_cli_all_pairs_end_to_end(tmp_path, capsys, synthetic_rows):
    csv, out = tmp_path / "r.csv", tmp_path / "leaderboard.md"
    pd.DataFrame(synthetic_rows).to_csv(csv, index=False)
    assert main(["compare", "--all-pairs", str(csv), "--alpha", "0.01", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text(encoding="utf-8")
    assert f"**Leaderboard** of `{csv}`: 3 runs on the same 40 windows" in printed and "α = 0.01" in printed
    assert "| 3 | `B` |" in printed and "Of the 3 pairs, 2 are resolved" in printed
    assert "a: A, C; b: B" in printed or "a: C, A; b: B" in printed
    assert main(["compare", str(csv), str(csv)]) == 0  # the two-report diff still works
    assert "**Compare.**" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["compare", "{csv}"], "compare needs two reports, A and B (got only {csv}); or rank"),
    (["compare", "--all-pairs", "{csv}", "{csv}"], "--all-pairs ranks the runs of one report; got two"),
    (["compare", "{csv}", "{csv}", "--alpha", "0.1"], "--alpha applies to --all-pairs only"),
    (["compare", "--all-pairs", "{csv}", "--alpha", "1.5"], "alpha must be in (0, 1), got 1.5"),
    (["compare", "--all-pairs", "{bare}"], "{bare}: no per-window data (missing column(s) window_nll, window_tokens)"),
    (["compare", "--all-pairs", "{mixed}"], ("{mixed}: runs evaluated on different windows cannot be paired: "
                                             "eval_windows: 40 (A, B); 80 (C)")),
])
def test_cli_errors_are_clear(tmp_path, capsys, synthetic_rows, argv, message):
    paths = {"csv": tmp_path / "r.csv", "bare": tmp_path / "bare.csv", "mixed": tmp_path / "mixed.csv"}
    pd.DataFrame(synthetic_rows).to_csv(paths["csv"], index=False)
    pd.DataFrame({"run": ["a"], "ppl": [3.0]}).to_csv(paths["bare"], index=False)
    pd.DataFrame(synthetic_rows).assign(eval_windows=[40, 40, 80]).to_csv(paths["mixed"], index=False)
    assert main([a.format(**paths) for a in argv]) == 1
    assert message.format(**paths) in capsys.readouterr().err


@pytest.mark.parametrize("report", ["reports/smollm2_methods2025.csv", "reports/smollm2_seeds.results.jsonl"])
def test_a_committed_report_is_consistent(report):
    """On real rows: ranked by the stored ppl, letters shared exactly by the unresolved pairs, the adjacent
    columns read off the pairs, and every number of the Markdown generated from them."""
    from pathlib import Path

    rows = load_rows(Path(__file__).resolve().parents[1] / report)
    table, pairs = leaderboard(rows)
    stored = rows.drop_duplicates("run", keep="last").set_index("run")["ppl"]
    np.testing.assert_allclose(table["ppl"], stored.loc[table["run"]], rtol=1e-9)
    assert table["ppl"].is_monotonic_increasing and len(pairs) == len(table) * (len(table) - 1) // 2
    shown = dict(zip(table["run"], table["letters"]))
    for a, b, resolved in zip(pairs["a"], pairs["b"], pairs["resolved"]):
        assert bool(set(shown[a]) & set(shown[b])) == (not resolved), (a, b)
    by_pair = pairs.set_index(["a", "b"])
    for above, (_, r) in zip(table["run"], table.iloc[1:].iterrows()):
        assert r["p_holm"] == by_pair.loc[(above, r["run"]), "p_holm"]
    text = leaderboard_markdown(table, pairs)
    assert f"Of the {len(pairs)} pairs, {int(pairs['resolved'].sum())} are resolved" in text


# ---- {leaderboard} in a findings template ----

def test_findings_leaderboard_placeholder_renders_the_leaderboard_of_the_rows(synthetic_rows):
    """Reference: leaderboard_markdown of the same rows (main windows), and of the domain's columns renamed into the
    main ones (@DOMAIN); a seed group's spread reaches it; an unknown domain and a bad form fail naming them."""
    from quantlab.reporting import findings

    rng = np.random.default_rng(1)
    code = {r["run"]: rng.normal(1.5, 0.2, N_WINDOWS) + k * 0.1 for k, r in enumerate(synthetic_rows)}
    rows = [{**r, "eval_dataset": "wikitext2", "eval_split": "test", "ppl_pystdlib": math.exp(code[r["run"]].mean()),
             "window_nll_pystdlib": json.dumps((code[r["run"]] * TOK).tolist()),
             "window_tokens_pystdlib": json.dumps([TOK] * N_WINDOWS)} for r in synthetic_rows]
    frame = pd.DataFrame(rows)
    template = "Ranked:\n\n{leaderboard}\n\nCode:\n\n{leaderboard@pystdlib}\n"
    text = findings.findings_section(template, frame, frame, {})
    main_ref = pd.DataFrame(synthetic_rows)
    main_ref.attrs["source"] = "wikitext2 test windows"
    assert leaderboard_markdown(*leaderboard(main_ref)).strip() in text
    domain = pd.DataFrame([{"run": r["run"], "window_nll": r["window_nll_pystdlib"], "ppl": r["ppl_pystdlib"],
                            "window_tokens": r["window_tokens_pystdlib"], "eval_windows": N_WINDOWS, "seq_len": 512}
                           for r in rows])
    domain.attrs["source"] = "pystdlib test windows"
    code_md = leaderboard_markdown(*leaderboard(domain)).strip()
    assert code_md in text and code_md.splitlines()[4].startswith("| 1 | `A` |")  # A has the lowest code NLL
    assert findings.parse("{leaderboard}")[0].runs() == []
    findings.check_domains(template, ["wikitext2", "pystdlib"])
    with pytest.raises(findings.FindingsError, match=r"\{leaderboard@python\} names unknown domain 'python'"):
        findings.check_domains("{leaderboard@python}", ["wikitext2", "pystdlib"])
    with pytest.raises(findings.FindingsError, match=r"write \{leaderboard\} or \{leaderboard@DOMAIN\}"):
        findings.parse("{leaderboard@}")
    with pytest.raises(findings.FindingsError, match=r"\{leaderboard@wiki\}: the rows have no window_nll_wiki"):
        findings.findings_section("{leaderboard@wiki}", frame, frame, {})
