"""Plugins: outside methods, formats and observers, loaded by an experiment's `plugins` list or an installed package's
entry point, with one-line errors naming the plugin; the docs' stochastic-rounding method does what its paper says."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from conftest import registries_restored
from test_docs import REPO, blocks

import quantlab
from quantlab.cli import main
from quantlab.core import formats
from quantlab.runs.experiment import load_experiment
from quantlab.util import plugins

METHOD = '''
from dataclasses import dataclass
import quantlab
from quantlab.core.lifecycle import freeze_all, swap_in_quant_linears

@dataclass(frozen=True)
class HalfConfig(quantlab.RTNConfig):
    pass

@quantlab.register_method
class Half(quantlab.Method):
    name = "{name}"
    config_cls = HalfConfig
    def prepare(self, model, config):
        swap_in_quant_linears(model, config.selection, config.weight_spec)
    def convert(self, model, config):
        freeze_all(model)
'''


@pytest.fixture(autouse=True)
def _isolated():
    with registries_restored():
        yield


def _experiment(folder, model_dir, plugin="plug_half", method="plug_half", extra=""):
    (folder / "exp.toml").write_text(textwrap.dedent(f'''
        name = "plugged"
        model = "{model_dir}"
        device = "cpu"
        plugins = ["{plugin}"]
        {extra}
        [eval]
        dataset = "{model_dir / 'sample.txt'}"
        seq_len = 32
        max_windows = 2
        latency = false
        [[run]]
        name = "fp32"
        method = "none"
        [[run]]
        name = "outside"
        method = "{method}"
        bits = 4
        group_size = 16
        '''))
    return folder / "exp.toml"


def test_a_method_beside_the_experiment_file_runs_from_it(tiny_model_dir, tmp_path):
    (tmp_path / "plug_half.py").write_text(METHOD.format(name="plug_half"))
    toml = _experiment(tmp_path, tiny_model_dir)
    assert main(["-q", "run", str(toml), "--reports-dir", str(tmp_path / "r")]) == 0
    df = __import__("pandas").read_csv(tmp_path / "r" / "plugged.csv").set_index("run")
    assert df.loc["outside", "method"] == "plug_half" and df.loc["outside", "scheme"] == "w4 g16 sym"
    assert df.loc["outside", "bits"] == 4 and df.loc["outside", "group_size"] == 16 and df.loc["outside", "ppl"] > 0
    assert load_experiment(toml).plugins == ("plug_half",)


@pytest.mark.parametrize("source,match", [
    (None, r"plugin 'plug_half' \(listed in plugins, searched first in .*\) failed to load: ModuleNotFoundError"),
    ("def broken(:\n", r"plugin 'plug_half' .* failed to load: SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", r"plugin 'plug_half' .* failed to load: RuntimeError: no GPU here"),
    (METHOD.format(name="rtn"), r"plugin 'plug_half' .* failed to load: ValueError: method 'rtn' is already registered"),
])
def test_a_plugin_that_fails_names_itself_and_the_file(tiny_model_dir, tmp_path, capsys, source, match):
    if source is not None:
        (tmp_path / "plug_half.py").write_text(source)
    toml = _experiment(tmp_path, tiny_model_dir)
    with pytest.raises(plugins.PluginError, match=str(toml).replace(".", r"\.") + ": " + match):
        load_experiment(toml)
    assert main(["run", str(toml), "--dry-run"]) == 1  # the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("quantlab: error: ") and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("value,match", [
    ("\"plug_half\"", r"plugins must be a list of module names"),
    ("[\"../plug_half\"]", r"plugin '\.\./plug_half' is not a module name"),
    ("[\"plug_half.py\"]", r"plugin 'plug_half\.py' is not a module name"),
    ("[3]", r"plugin 3 is not a module name"),
])
def test_bad_plugin_lists_fail_before_anything_loads(tiny_model_dir, tmp_path, value, match):
    toml = _experiment(tmp_path, tiny_model_dir)
    toml.write_text(toml.read_text().replace('plugins = ["plug_half"]', f"plugins = {value}"))
    with pytest.raises(ValueError, match=match):
        load_experiment(toml)


def test_an_installed_entry_point_is_loaded_for_every_experiment(tiny_model_dir, tmp_path, monkeypatch):
    """A package advertising a module in the quantlab.plugins group: its method is usable without a plugins line."""
    site = tmp_path / "site"
    (site / "qlplugpkg").mkdir(parents=True)
    (site / "qlplugpkg" / "__init__.py").write_text(METHOD.format(name="plug_entry"))
    dist = site / "qlplugpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qlplugpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[quantlab.plugins]\nplug_entry = qlplugpkg\n")
    monkeypatch.syspath_prepend(str(site))
    plugins._installed = None
    toml = _experiment(tmp_path, tiny_model_dir, method="plug_entry")
    toml.write_text(toml.read_text().replace('plugins = ["plug_half"]\n', ""))
    exp = load_experiment(toml)
    assert "plug_entry" in plugins.load_installed_plugins() and exp.runs[1].config.__class__.__name__ == "HalfConfig"


def test_a_broken_entry_point_names_itself_and_its_package(tmp_path, monkeypatch):
    site = tmp_path / "site"
    dist = site / "qlplugpkg-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qlplugpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[quantlab.plugins]\nbroken = qlplugpkg_missing\n")
    monkeypatch.syspath_prepend(str(site))
    plugins._installed = None
    with pytest.raises(plugins.PluginError, match=r"plugin 'broken' = 'qlplugpkg_missing' \(entry point group "
                                                  r"'quantlab.plugins' of qlplugpkg\) failed to load"):
        plugins.load_installed_plugins()


def test_taken_names_fail_in_every_registry():
    with pytest.raises(ValueError, match="method 'rtn' is already registered"):
        quantlab.register_method(type("Again", (quantlab.Method,), {"name": "rtn"}))
    with pytest.raises(ValueError, match=r"format 'nf4' is already registered; taken: int, fp8_e4m3"):
        quantlab.register_format(formats.FORMATS["nf4"])
    with pytest.raises(ValueError, match=r"observer 'minmax' is already registered"):
        quantlab.register_observer("minmax", lambda **k: None)
    with pytest.raises(ValueError, match=r"run extra 'kv_cache' is already registered \(by quantlab.extras.kv_cache\)"):
        quantlab.register_extra(type("KV", (quantlab.RunExtra,), {"key": "kv_cache"}))


def test_a_lookup_table_format_quantizes_to_its_levels_and_freezes_exactly():
    """A registered 4-bit table: every dequantized weight is a level times its block's absmax scale (the reference,
    computed here), and the frozen forward equals the fake-quant forward (atol 0)."""
    levels = tuple(torch.linspace(-1, 1, 16).tolist())
    quantlab.register_format(quantlab.Format("lin4_test", quantlab.Element("lin4_test", 4, "nf", levels=levels),
                                             "float", 32))
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8, bias=False)
    model = torch.nn.Sequential(linear)
    config = quantlab.make_config({"method": "rtn", "format": "lin4_test", "include": ["*"], "exclude": []})
    assert config.bits == 4 and config.group_size == 32
    quantlab.quantize(model, config)
    layer = model[0]
    w = linear.weight.detach().view(8, 2, 32)
    scale = w.abs().amax(-1, keepdim=True)
    table = torch.tensor(levels)
    reference = table[((w / scale)[..., None] - table).abs().argmin(-1)] * scale  # nearest level, then scaled
    assert torch.allclose(layer.quantized_weight().view(8, 2, 32), reference, atol=1e-6)
    with pytest.raises(ValueError, match="levels must ascend strictly within"):
        quantlab.Element("bad", 4, "nf", levels=tuple(reversed(levels)))


def test_a_registered_observer_sets_static_ranges():
    seen = {}

    class Fixed(quantlab.Observer):
        def __init__(self, per_channel, where, bits, symmetric):
            seen[where] = (per_channel, bits, symmetric)

        def update(self, x):
            pass

        def range(self):
            return torch.tensor(-2.0), torch.tensor(2.0)

    quantlab.register_observer("fixed_pm2", Fixed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4))
    config = quantlab.make_config({"method": "static", "observer": "fixed_pm2", "act_bits": 8, "act_symmetric": True,
                                   "base": {"method": "rtn", "bits": 8, "include": ["*"], "exclude": []}})
    quantlab.quantize(model, config, calibration=[torch.randn(2, 16)])
    assert seen == {"0": (False, 8, True)}
    assert torch.allclose(model[0].act_quant.scale.float(), torch.tensor(2.0 / 127), rtol=1e-3)


def test_capabilities_not_names_decide_what_composes(tmp_path, tiny_model_dir):
    """An outside method that folds channel scales is refused with an online rotation, as AWQ is, by its answer."""
    (tmp_path / "plug_folds.py").write_text(METHOD.format(name="plug_folds") +
                                            "    def folds_channel_scales(self, config):\n        return True\n")
    toml = _experiment(tmp_path, tiny_model_dir, plugin="plug_folds", method="plug_folds")
    toml.write_text(toml.read_text().replace("group_size = 16", 'group_size = 16\nrotation = { scope = "online" }'))
    with pytest.raises(ValueError, match=r"scope 'online' .* does not compose with plug_folds"):
        load_experiment(toml)


def _docs_method():
    """The stochastic-rounding method of docs/plugins.md, imported from the page's own code block."""
    code = next(c for _, attrs, c in blocks(REPO / "docs" / "plugins.md") if attrs.get("title") == "stochastic_rounding.py")
    module = type(sys)("plug_docs_sr")
    sys.modules["plug_docs_sr"] = module  # before exec: dataclasses look their module up
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)
    return module


def test_the_docs_stochastic_rounding_is_unbiased_and_stays_on_the_grid():
    """Gupta et al.'s property: each weight goes to one of its two neighbouring grid points, and averaged over
    seeds the quantized weight approaches the float one (mean error < 4% of a step over 400 draws), where
    round-to-nearest keeps a fixed error of up to half a step."""
    _docs_method()
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 4, bias=False)
    w = linear.weight.detach().clone()
    spec = quantlab.WeightSpec(bits=3, group_size=32, symmetric=True)
    p = spec.qparams(w)
    step = p.scale.float().repeat_interleave(32, dim=-1)
    lower = torch.floor(w / step) * step
    total = torch.zeros_like(w)
    for seed in range(400):
        model = torch.nn.Sequential(torch.nn.Linear(64, 4, bias=False))
        model[0].weight.data.copy_(w)
        quantlab.quantize(model, quantlab.make_config({"method": "stochastic_rounding", "bits": 3, "group_size": 32,
                                                       "seed": seed, "include": ["*"], "exclude": []}))
        q = model[0].quantized_weight()
        inside = (w.abs() < 3 * step)  # away from the clipped ends of the 3-bit grid
        on_grid = torch.isclose(q, lower, atol=1e-6) | torch.isclose(q, lower + step, atol=1e-6)
        assert on_grid[inside].all()
        total += q
    bias = ((total / 400 - w).abs() / step)[inside]
    rtn = ((spec.fake_quantize(w, p) - w).abs() / step)[inside]
    assert bias.mean() < 0.04 < rtn.mean()
