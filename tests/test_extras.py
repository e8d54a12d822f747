"""Run extras share one interface: a fourth extra is one registration, and every place that handles extras (parsing,
run keys, the runner, the TOML writer, the scheme column) picks it up; the run owns what its extras apply. And the
grid columns of result rows come from the effective grid, in every committed report too."""
from __future__ import annotations

import contextlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

import quantlab
from quantlab.core import extras
from quantlab.core.grid import grid_fields
from quantlab.core.registry import make_config
from quantlab.kvcache import KVCacheConfig, applied_kv_config, kv_quant
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.tomlwrite import experiment_toml

REPO = Path(__file__).resolve().parents[1]
EVENTS = []


@dataclass(frozen=True)
class ProbeConfig:
    scale: float = 1.0

    def describe(self):
        return f"probe x{self.scale:g}"


class Probe(quantlab.RunExtra):
    """Scales the output head's logits while the run is evaluated; records when it is entered and left."""

    key, config_cls, stage = "probe", ProbeConfig, extras.AFTER_EXPORT

    @contextlib.contextmanager
    def apply(self, model, config):
        EVENTS.append("enter")
        head = model.get_output_embeddings()
        handle = head.register_forward_hook(lambda m, a, out: out * config.scale)
        try:
            yield {"probe_scale": config.scale}
        finally:
            handle.remove()
            EVENTS.append("exit")


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(extras, "_EXTRAS", dict(extras._EXTRAS))  # registered for this test only
    quantlab.register_extra(Probe)
    EVENTS.clear()
    yield


def _experiment(model_dir, runs):
    return parse_experiment({"name": "extras", "model": str(model_dir), "device": "cpu", "run": runs, "eval": {
        "dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2, "kl_windows": 2,
        "prefill_tokens": 8, "decode_tokens": 2, "latency_repeats": 1}})


def test_a_fourth_extra_is_one_registration(probe, tiny_model_dir, tmp_path, monkeypatch):
    """Parsed from its table, in the run key, applied around the evaluation only (logits x2 change the ppl), left
    before the next run, never on the float model, in the row, the scheme and the TOML the writer gives back."""
    runs = [{"name": "fp32", "method": "none"}, {"name": "w8-probe", "method": "rtn", "bits": 8, "probe": {"scale": 2.0}},
            {"name": "w8", "method": "rtn", "bits": 8}]
    exp = _experiment(tiny_model_dir, runs)
    assert exp.runs[1].extra("probe") == ProbeConfig(2.0) and exp.runs[2].extra("probe") is None
    cpu = torch.device("cpu")
    assert runner.run_key(exp, exp.runs[1], cpu) != runner.run_key(exp, exp.runs[2], cpu)
    checked = []
    real = runner.evaluate_run

    def watch(ctx, run):  # the float model (KL reference) never carries the hook, before or after any run
        checked.append(len(ctx.model.get_output_embeddings()._forward_hooks))
        out = real(ctx, run)
        checked.append(len(ctx.model.get_output_embeddings()._forward_hooks))
        return out

    monkeypatch.setattr(runner, "evaluate_run", watch)
    df = runner.run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert EVENTS == ["enter", "exit"] and checked == [0] * 6
    assert df.loc["w8-probe", "probe_scale"] == 2.0 and df.loc["w8-probe", "scheme"] == "w8 channel sym + probe x2"
    assert df.loc["w8-probe", "ppl"] != df.loc["w8", "ppl"]  # the hook was on during the evaluation
    assert parse_experiment(tomllib.loads(experiment_toml(exp))) == exp


def test_an_unknown_extra_key_is_a_method_field_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"run 'a': unknown config key\(s\) 'probe' for method 'rtn'"):
        _experiment(tiny_model_dir, [{"name": "a", "method": "rtn", "probe": {}}])


def test_extra_tables_name_their_bad_keys(probe, tiny_model_dir):
    with pytest.raises(ValueError, match=r"run 'a': probe: unknown key\(s\) 'scal'; valid: scale"):
        _experiment(tiny_model_dir, [{"name": "a", "method": "rtn", "probe": {"scal": 2}}])
    with pytest.raises(ValueError, match=r"run 'a': probe must be a table"):
        _experiment(tiny_model_dir, [{"name": "a", "method": "rtn", "probe": 2}])


# ---- the KV cache has one owner ----------------------------------------------------------------------------------

def test_kv_quant_restores_what_its_caller_applied(tiny_model):
    model = tiny_model[0]
    a, b = KVCacheConfig(bits=8), KVCacheConfig(bits=4)
    with kv_quant(model, a):
        with kv_quant(model, a):  # the owner's config again: nothing to apply, nothing to remove
            assert applied_kv_config(model) == a
        assert applied_kv_config(model) == a
        with kv_quant(model, b):
            assert applied_kv_config(model) == b
        assert applied_kv_config(model) == a  # the inner block's config is gone, the owner's is back
    assert applied_kv_config(model) is None


def test_latency_decodes_on_the_applied_cache_and_leaves_it_applied(tiny_model):
    """The runner applies a run's kv_cache once; measure_latency finds it, decodes on its quantized cache, and does
    not remove it (the trap was: latency's own kv_quant removed the runner's on exit)."""
    model = tiny_model[0]
    prompt = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    kv = KVCacheConfig(bits=4)
    with kv_quant(model, kv):
        row = quantlab.measure_latency(model, prompt, new_tokens=2, repeats=1)
        assert applied_kv_config(model) == kv
    assert row["kv_config"] == "kv4 ghead asym" and row["kv_cache_mib"] < row["kv_cache_float_mib"]
    assert "kv_config" not in quantlab.measure_latency(model, prompt, new_tokens=2, repeats=1)


# ---- grid columns -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,expected", [
    ({"method": "none"}, (32, None, None, "float32", None)),
    ({"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}, (3, 64, False, "int", None)),
    ({"method": "awq", "base": {"method": "rtn", "bits": 4, "group_size": 128}}, (4, 128, True, "int", None)),
    ({"method": "dynamic"}, (8, None, True, "int", 8)),
    ({"method": "dynamic", "act_bits": 4, "base": {"method": "gptq", "bits": 4, "group_size": 64}},
     (4, 64, True, "int", 4)),
    ({"method": "static", "act_bits": 8}, (8, None, True, "int", 8)),
    ({"method": "smoothquant"}, (8, None, True, "int", 8)),
    ({"method": "qat", "base": {"method": "rtn", "bits": 3, "group_size": 32}}, (3, 32, True, "int", None)),
    ({"method": "rtn", "format": "nf4"}, (4, 64, True, "nf4", None)),
    ({"method": "hqq"}, (4, 64, False, "int", None)),
])
def test_grid_fields_come_from_the_effective_grid(spec, expected):
    fields = grid_fields(make_config(spec))
    assert tuple(fields[k] for k in ("bits", "group_size", "symmetric", "format", "act_bits")) == expected


@pytest.mark.parametrize("csv", sorted(p.name for p in (REPO / "reports").glob("*.csv")
                                       if p.with_suffix("").name + ".results.jsonl"
                                       in {q.name for q in (REPO / "reports").glob("*.results.jsonl")}))
def test_every_committed_report_has_its_grid_columns(csv):
    """bits and format in every row, group_size where the scheme names a group, act_bits where it names activation
    bits; written as integers (no "4.0" in the file)."""
    df = pd.read_csv(REPO / "reports" / csv)
    assert df["bits"].notna().all() and df["format"].notna().all()
    for _, row in df.iterrows():
        group = re.search(r"\bg(\d+)\b", row["scheme"].split(" + ")[0])
        assert (row["group_size"] == int(group.group(1))) if group else pd.isna(row["group_size"]), row["run"]
        act = re.search(r"\+ a(\d+) ", row["scheme"])
        assert (row["act_bits"] == int(act.group(1))) if act else True, row["run"]
        if "source_format" in df and pd.notna(row["source_format"]):  # an imported checkpoint: the file's grid
            assert row["bits"] == int(re.search(r": w(\d+)\b", row["scheme"]).group(1)), row["run"]
            continue
        assert row["bits"] == grid_fields(make_config(_method_part(json.loads(row["config"]))), row["dtype"])["bits"]
    text = (REPO / "reports" / csv).read_text()
    header = text.splitlines()[0].split(",")
    for line in text.splitlines()[1:4]:
        cells = dict(zip(header, line.split(",")))
        assert not re.fullmatch(r"\d+\.0", cells["bits"]) and not re.fullmatch(r"\d+\.0", cells["group_size"])


def _method_part(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "name" and k not in extras.known_extras()}
