"""Experiment files: TOML with a model, an eval protocol, a calibration protocol and [[run]]s.

Everything is parsed and validated here, before any model loads ([eval], [calibration] and [execution]: protocols.py).

    name = "smollm2_quickstart"
    model = "smollm2-135m"
    findings = "RTN w4 g64: ppl {rtn-w4-g64:ppl:.1f}"   # filled from the rows (reporting/findings.py)
    [eval]
    seq_len = 512
    max_windows = 16
    [[run]]
    name = "rtn-w4-g64"
    method = "rtn"
    bits = 4
    group_size = 64
"""
from __future__ import annotations

import collections
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.extras import extras_to_dict, known_extras, parse_extras
from ..core.registry import config_to_dict, get_method, make_config
from ..models.data import domain_label
from ..reporting.template import check_domains, check_runs
from ..util.checks import check_dtype, check_name, utf8_error
from ..util.plugins import check_plugin_names, load_installed_plugins, load_plugins
from .protocols import CalibrationProtocol, EvalProtocol, ExecutionConfig, check_keys  # noqa: F401 (re-exported)
from .sweep import expand_sweep, first_run


@dataclass(frozen=True)
class RunSpec:
    name: str
    config: Any
    seed: int | None = None  # set when the run is one of a `seeds` list; None: the experiment's seed
    group: str | None = None  # the run's name before seed expansion ("gptq-w4" for "gptq-w4-seed1")
    backend: str = "simulated"  # "simulated" | "torchao" | "auto" | "onnxruntime" | "llama.cpp": real kernels
    # run extras (core/extras.py): ((RunExtra, config), ...) in registry order, or {key: table} (`rotation = {...}`,
    # `kv_cache = {...}`, `embedding = {...}`), parsed here
    extras: Any = ()
    calibration: Any = None  # a CalibrationProtocol: this run's own (a `calibration = {...}` table); None: the file's

    def __post_init__(self):
        from ..backends import check_backend

        check_name("run name", self.name)  # run names may reach paths (reports, checkpoints)
        check_backend(self.backend)
        if self.calibration is not None and not _depends_on_seed(self.config):
            raise ValueError(f"calibration = {{...}} applies to runs that calibrate or train; "
                             f"{get_method(self.config).name} here does neither")
        extras = self.extras if isinstance(self.extras, dict) else {e.key: c for e, c in self.extras}
        object.__setattr__(self, "extras", parse_extras(extras))
        for extra, config in self.extras:
            reason = extra.refusal(config, self.backend)
            if reason:
                raise ValueError(f"backend {self.backend!r} {reason}; use backend = \"simulated\"")
            extra.check(config, self.config, self.backend)

    def extra(self, key: str):
        """The config of the run's extra `key` (e.g. "kv_cache"), or None."""
        return next((config for extra, config in self.extras if extra.key == key), None)

    def to_dict(self) -> dict:
        return {"name": self.name, **config_to_dict(self.config), **extras_to_dict(self.extras)}


@dataclass(frozen=True)
class Experiment:
    name: str
    model: str
    runs: tuple[RunSpec, ...]
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    seeds: tuple[int, ...] | None = None  # calibration-dependent runs repeat once per seed (see _expand_seeds)
    description: str = ""  # the setup: what is run and why
    findings: str = ""  # a template the report fills from the rows (quantlab/reporting/findings.py)
    eval: EvalProtocol = field(default_factory=EvalProtocol)
    calibration: CalibrationProtocol = field(default_factory=CalibrationProtocol)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    # modules imported before the runs are validated (util/plugins.py): outside methods, formats, observers, extras
    plugins: tuple[str, ...] = ()
    # the float model KL and top-1 agreement are measured against when `model` is a quantized checkpoint (a
    # compressed-tensors, GPTQ or AWQ folder, imported with its codes: backends/ckpt_import.py); None: no KL
    reference: str | None = None

    def __post_init__(self):
        check_name("experiment name", self.name)  # reports/<name>.csv, .md, .results.jsonl
        check_dtype("dtype", self.dtype)
        if not self.runs:
            raise ValueError(f"experiment {self.name!r} has no [[run]] entries")
        counts = collections.Counter(r.name for r in self.runs)
        dupes = sorted(n for n, c in counts.items() if c > 1)
        if dupes:
            raise ValueError(f"experiment {self.name!r}: duplicate run name(s) {', '.join(dupes)}")
        if not isinstance(self.findings, str):
            raise ValueError(f"experiment {self.name!r}: findings must be a string (a template), "
                             f"got {type(self.findings).__name__}")
        if self.eval.dtype != "float32" and self.dtype != "float32":
            raise ValueError(f"experiment {self.name!r}: eval.dtype = {self.eval.dtype!r} computes a float32 model's "
                             f"evaluation in {self.eval.dtype}; this model loads as dtype = {self.dtype!r}: drop one")
        for r in self.runs:
            if self.eval.dtype != "float32" and r.backend != "simulated":
                raise ValueError(f"experiment {self.name!r}: run {r.name!r} has backend = {r.backend!r}; eval.dtype = "
                                 f"{self.eval.dtype!r} applies to PyTorch's simulated models only (backend "
                                 f"\"simulated\", the default)")
            for extra, _ in r.extras:
                if self.eval.memory == "isolated" and not extra.replayed_in_isolation:
                    raise ValueError(f"experiment {self.name!r}: run {r.name!r} has {extra.key} = {{...}}, which the "
                                     f"isolated memory process (it reloads the model) does not replay; set [eval] "
                                     f"memory = \"none\" for this experiment")
                if self.eval.metric not in extra.metrics:
                    raise ValueError(f"experiment {self.name!r}: run {r.name!r}: {extra.key} applies to metric "
                                     f"{' or '.join(map(repr, extra.metrics))}, not to metric {self.eval.metric!r}")
            if r.backend == "onnxruntime":
                from ..backends.ort import check_ort_run

                check_ort_run(self, r)
            if r.backend == "llama.cpp":
                _check_llamacpp_run(self, r)
        _check_imported(self)


def _check_imported(exp: Experiment) -> None:
    """A quantized checkpoint as `model` is evaluated as imported (backends/ckpt_import.py): its runs are the
    baseline method alone ("none": no extras, backend "simulated"), on perplexity; `reference` applies to such a
    model only. Reads the folder's JSON, no weights."""
    from ..backends.ckpt_import import checkpoint_format

    where = f"experiment {exp.name!r}"
    if exp.reference is not None and (not isinstance(exp.reference, str) or not exp.reference):
        raise ValueError(f"{where}: reference must be a model name or path, got {exp.reference!r}")
    fmt = checkpoint_format(exp.model)
    if fmt is None:
        if exp.reference is not None:
            raise ValueError(f"{where}: reference = {exp.reference!r} applies to a model that is a quantized "
                             f"checkpoint (compressed-tensors, GPTQ, AWQ); model {exp.model!r} is not one")
        return
    if exp.eval.metric != "perplexity" or exp.eval.memory == "isolated":
        raise ValueError(f"{where}: model {exp.model!r} is a {fmt} checkpoint, evaluated as imported on [eval] "
                         f"metric \"perplexity\" with memory other than \"isolated\" (its process reloads the model)")
    for r in exp.runs:
        if not get_method(r.config).baseline or r.extras or r.backend != "simulated":
            raise ValueError(f"{where}: run {r.name!r}: model {exp.model!r} is a {fmt} checkpoint, evaluated as "
                             f"imported: its runs take method \"none\", no extras and backend \"simulated\"")


def _check_llamacpp_run(exp: "Experiment", run: RunSpec) -> None:
    """backend = "llama.cpp" before any weights load: the extra is installed, the metric is perplexity, and the
    model has a GGUF to lend the export its tokenizer."""
    from ..backends.llamacpp import require_llamacpp
    from ..models.loading import ALIASES, GGUFAlias

    where = f"experiment {exp.name!r}: run {run.name!r}"
    try:
        require_llamacpp()
    except ImportError as e:
        raise ValueError(f"{where}: {e}") from None
    if exp.eval.metric != "perplexity":
        raise ValueError(f"{where}: backend 'llama.cpp' runs causal LMs (metric 'perplexity'), not {exp.eval.metric!r}")
    model = exp.model
    if not (isinstance(ALIASES.get(model), GGUFAlias) or str(model).endswith(".gguf")
            or (Path(model).expanduser() / "quantlab_source.json").is_file()):
        raise ValueError(f"{where}: backend 'llama.cpp' writes a GGUF whose tokenizer comes from the model's own "
                         f"GGUF; model {model!r} has none (GGUF aliases: "
                         f"{', '.join(n for n, a in ALIASES.items() if isinstance(a, GGUFAlias))}, or a .gguf path)")


def _check_seeds(seeds, where: str) -> tuple[int, ...]:
    if (not isinstance(seeds, (list, tuple)) or not seeds
            or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds)):
        raise ValueError(f"{where}: seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: seeds {list(seeds)} repeat a value")
    return tuple(seeds)


def _depends_on_seed(config) -> bool:
    """Calibration samples and training data order are drawn from the seed."""
    method = get_method(config)
    return method.needs_calibration_for(config) or method.needs_training_for(config)


def _expand_seeds(run: RunSpec, run_seeds, exp_seeds) -> list[RunSpec]:
    """One RunSpec per seed, named "<name>-seed<s>", for runs whose result depends on a seed.

    A run's own `seeds` always expand it; the experiment's `seeds` expand only runs that need
    calibration or training data (the seed draws the windows and their order), since RTN / the
    baseline are deterministic and would repeat identical numbers.
    """
    seeds = run_seeds if run_seeds is not None else (
        exp_seeds if exp_seeds and _depends_on_seed(run.config) else None)
    if seeds is None:
        return [run]
    return [dataclasses.replace(run, name=f"{run.name}-seed{s}", seed=s, group=run.name) for s in seeds]


def _parse_runs(tables: list, exp_seeds, where: str, calib_table: dict | None = None) -> tuple[RunSpec, ...]:
    """[[run]] tables -> RunSpecs, a run's `seeds` key (or the experiment's) expanding it per seed."""
    runs = []
    for i, table in enumerate(tables):
        table = dict(table)
        seeds = table.pop("seeds", None)
        run = _parse_run(i, table, where, calib_table)
        seeds = None if seeds is None else _check_seeds(seeds, f"{where}: run {run.name!r}")
        runs.extend(_expand_seeds(run, seeds, exp_seeds))
    return tuple(runs)


def _run_calibration(value, calib_table: dict | None):
    """A run's `calibration = {...}`: the experiment's [calibration] with these fields replaced."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"calibration must be a table, e.g. calibration = {{ num_samples = 128 }}, got {value!r}")
    check_keys(value, CalibrationProtocol, "calibration")
    base = dict(calib_table or {})
    if "datasets" in value and "dataset" not in value:  # the run's datasets replace the file's dataset too
        base.pop("dataset", None)
    if "dataset" in value and "datasets" not in value:
        base.pop("datasets", None)
        base.pop("mix", None)
    return CalibrationProtocol(**(base | value))


def _parse_run(i: int, table: dict, where: str, calib_table: dict | None = None) -> RunSpec:
    table = dict(table)
    name = table.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: [[run]] #{i + 1} needs a non-empty 'name'")
    try:
        check_name("run name", name)
    except ValueError as e:
        raise ValueError(f"{where}: [[run]] #{i + 1}: {e}") from None
    backend = table.pop("backend", "simulated")
    extras = {key: table.pop(key) for key in known_extras() if key in table}
    calibration = table.pop("calibration", None)
    try:
        return RunSpec(name, make_config(table), backend=backend, extras=extras,
                       calibration=_run_calibration(calibration, calib_table))
    except (ValueError, KeyError, TypeError) as e:
        msg = e.args[0] if e.args else str(e)
        raise ValueError(f"{where}: run {name!r}: {msg}") from None


def parse_experiment(data: dict, where: str = "experiment", default_name: str = "experiment",
                     plugin_dir: str | Path | None = None) -> Experiment:
    """Validate a parsed TOML dict into an Experiment (all run configs built).

    Plugins load first: the installed ones (entry-point group `quantlab.plugins`) and the file's `plugins` list,
    searched first in `plugin_dir` (load_experiment passes the file's folder), so runs may name what they register.
    """
    data = dict(data)
    plugins = check_plugin_names(data.pop("plugins"), where) if "plugins" in data else ()
    load_installed_plugins()
    load_plugins(plugins, plugin_dir, where)
    if "runs" in data:
        raise ValueError(f"{where}: write runs as [[run]] tables, not 'runs'")
    if not isinstance(data.get("sweep", []), list) or not all(isinstance(t, dict) for t in data.get("sweep", [])):
        raise ValueError(f"{where}: write sweeps as [[sweep]] tables")
    check_keys({k: v for k, v in data.items() if k not in ("run", "sweep")}, Experiment, where)
    if "model" not in data:
        raise ValueError(f"{where}: missing required key 'model'")
    eval_table, calib_table = data.pop("eval", {}), data.pop("calibration", {})
    exec_table = data.pop("execution", {})
    check_keys(exec_table, ExecutionConfig, f"{where} [execution]")
    check_keys(eval_table, EvalProtocol, f"{where} [eval]")
    check_keys(calib_table, CalibrationProtocol, f"{where} [calibration]")
    exp_seeds = _check_seeds(data.pop("seeds"), where) if "seeds" in data else None
    name = data.pop("name", default_name)
    try:
        check_name("experiment name", name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    tables = list(data.pop("run", []))
    runs = list(_parse_runs(tables, exp_seeds, where, calib_table))
    sweeps = [(sweep, f"{where}: [[sweep]] #{i + 1}") for i, sweep in enumerate(data.pop("sweep", []))]
    for sweep, sweep_where in sweeps:  # what all of a sweep's runs share fails before any grid expands
        _parse_runs([first_run(sweep, sweep_where)], exp_seeds, sweep_where, calib_table)
    for sweep, sweep_where in sweeps:  # errors name the sweep, not only the derived run name
        expanded = expand_sweep(sweep, sweep_where)
        runs += _parse_runs(expanded, exp_seeds, sweep_where, calib_table)
        tables += expanded
    runs = tuple(runs)
    counts = collections.Counter(t.get("name") for t in tables)
    dupes = sorted(n for n, c in counts.items() if c > 1 and n is not None)
    if dupes:
        raise ValueError(f"{where}: duplicate run name(s) {', '.join(dupes)} (a [[sweep]] names its runs by their "
                         f"values: rename the [[run]] or give the sweep a 'name')")
    try:  # the protocols' own checks (sizes, names, choices) name the file too
        protocols = {"eval": EvalProtocol(**eval_table), "calibration": CalibrationProtocol(**calib_table),
                     "execution": ExecutionConfig(**exec_table)}
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e.args[0] if e.args else e}") from None
    exp = Experiment(name=name, runs=runs, seeds=exp_seeds, plugins=plugins, **protocols, **data)
    if exp.execution.qat_processes > 1 and not any(get_method(r.config).needs_training_for(r.config) for r in runs):
        raise ValueError(f"{where}: [execution] qat_processes = {exp.execution.qat_processes} applies to runs that "
                         f"train (qat), and no run here trains")
    # every run a findings placeholder names must be a run (or seed group) of the file; checked here, not in
    # Experiment, so that a subset of the runs (dataclasses.replace) still reports, noting what it lacks
    check_runs(exp.findings, [r.name for r in runs] + [r.group for r in runs if r.group], f"{where}: findings")
    check_domains(exp.findings, [domain_label(d) for d in exp.eval.datasets or ()], f"{where}: findings")
    return exp


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment TOML file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")  # as tomllib.load decodes (no newline translation)
        text = text.removeprefix("\ufeff")  # a byte-order mark ("UTF-8 with BOM" editors): tomllib rejects it
    except UnicodeDecodeError as e:
        raise utf8_error(path, e) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array / inline table
        raise ValueError(f"{path}: invalid TOML: arrays or inline tables nest too deeply "
                         f"(Python's recursion limit); an experiment nests a few levels at most") from None
    return parse_experiment(data, where=str(path), default_name=path.stem, plugin_dir=path.parent)
