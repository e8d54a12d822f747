"""The [eval], [calibration] and [execution] tables of an experiment file, validated (parsed by experiment.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..eval.perplexity import EVAL_DTYPES
from ..models.data import check_dataset, domain_label
from ..util.checks import check_int


def check_keys(table: dict, cls: type, where: str) -> None:
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(valid))}")


MEMORY_MODES = ("none", "isolated")

# Upper limits of the sizes that allocate (tensors, windows, processes), generous but finite, so that a typo
# (num_samples = 1000000000) fails here, naming its field, rather than as an allocation error once the model loads.
MAX_SEQ_LEN = 1 << 20  # tokens: 1,048,576, past the longest context of today's models (1M); seq_len, max_length
MAX_WINDOWS = 1_000_000  # eval windows / sentences / documents: WikiText-2's test split is ~1,100 windows of 256
MAX_EVAL_TOKENS = 1_000_000_000  # eval.max_tokens: a billion tokens is far past any held-out split
MAX_CALIB_SAMPLES = 100_000  # calibration windows held at once (GPTQ uses 128): 100k x 2048 int64 ids = 1.6 GB
MAX_KL_WINDOWS = 100_000  # each KL window runs the float model once more; the default is 8
MAX_REPEATS = 10_000  # latency repeats: each is a full prefill + decode; the default is 3
MAX_BATCH = 4_096  # lm-eval batch size: requests in one forward
MAX_PROCESSES = 1_024  # QAT data-parallel processes, each holding a copy of the model
WINDOW_ORDERS = ("first", "spread")  # models.data.WINDOW_ORDERS
BOS_MODES = ("none", "prepend")  # models.data.BOS_MODES: what eval_windows / calibration_windows do with a BOS


@dataclass(frozen=True)
class EvalProtocol:
    """What to measure: perplexity windows (GPTQ protocol) + KL for causal LMs, or embedding
    fidelity for encoders; and latency settings."""

    metric: str = "perplexity"  # "perplexity" (causal LMs) | "embedding" (encoders: cosine vs float)
    dataset: str = "wikitext2"
    # several domains in one pass: every run is evaluated on each (ppl_<domain>, window_nll_<domain>, ...); the
    # first is `dataset` (the ppl, KL and latency columns). None: `dataset` alone, no per-domain columns
    datasets: tuple[str, ...] | None = None
    split: str = "test"
    seq_len: int = 2048
    max_windows: int | None = None  # None: the whole split
    max_tokens: int | None = None
    # which windows a limit keeps: "first" (the GPTQ protocol's start of the split) or "spread" (evenly spaced over
    # the split: a short budget that samples the whole text, e.g. a code domain whose first files are a few)
    windows: str = "first"
    kl_windows: int = 8  # first k eval windows also measure KL / top-1 vs the baseline; 0 = off
    # "bfloat16": perplexity and KL computed under bf16 autocast (faster where the CPU has AVX512_BF16 / AMX); every
    # row then states the float model's perplexity in float32 and in bfloat16 on the same windows. Latency stays fp32
    dtype: str = "float32"
    # "prepend": every window the model reads (evaluation, calibration, QAT training) starts with the tokenizer's
    # BOS, followed by seq_len - 1 text tokens (models trained to always see one, e.g. Gemma); "none": text only
    bos: str = "none"
    num_sentences: int = 256  # embedding metric: first N sentences of the split
    max_length: int = 128  # embedding metric: tokens per sentence at most
    latency: bool = True
    prefill_tokens: int = 128
    decode_tokens: int = 32
    latency_repeats: int = 3
    # "none": no per-run CPU memory column (an in-process peak covers the whole process's life);
    # "isolated": each run's peak RSS of one seq_len forward, in a fresh process (eval/memprobe.py)
    memory: str = "none"
    # lm-evaluation-harness tasks run on each run's model as it is in memory (eval/lmeval.py), adding columns
    # lmeval_<task>_<metric> and _stderr; "wikitext_local" runs offline, lm-eval's own tasks need their data set
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_limit: int | None = None  # the first N documents of each task; None: all (--full drops it)
    lm_eval_max_length: int | None = None  # rolling-window tokens; None: the model's max positions (lm-eval's)
    lm_eval_batch_size: int = 1

    def __post_init__(self):
        _check_lm_eval(self)
        if self.metric not in ("perplexity", "embedding"):
            raise ValueError(f"eval.metric {self.metric!r} unknown; known: perplexity, embedding")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"eval.memory {self.memory!r} unknown; known: {', '.join(MEMORY_MODES)}")
        if self.memory == "isolated" and self.metric != "perplexity":
            raise ValueError(f"eval.memory = 'isolated' needs metric = 'perplexity' (the probe loads causal LMs), "
                             f"got metric {self.metric!r}")
        check_int("eval.seq_len", self.seq_len, 1, MAX_SEQ_LEN)
        check_int("eval.num_sentences", self.num_sentences, 1, MAX_WINDOWS)
        check_int("eval.max_length", self.max_length, 1, MAX_SEQ_LEN)
        check_int("eval.max_windows", self.max_windows, 1, MAX_WINDOWS, allow_none=True)
        check_int("eval.max_tokens", self.max_tokens, 1, MAX_EVAL_TOKENS, allow_none=True)
        for name in ("prefill_tokens", "decode_tokens"):  # one prompt + its KV cache: a context's length at most
            check_int(f"eval.{name}", getattr(self, name), 1, MAX_SEQ_LEN)
        check_int("eval.latency_repeats", self.latency_repeats, 1, MAX_REPEATS)
        check_int("eval.kl_windows", self.kl_windows, 0, MAX_KL_WINDOWS)
        if self.dtype not in EVAL_DTYPES:
            raise ValueError(f"eval.dtype {self.dtype!r} unknown; known: {', '.join(EVAL_DTYPES)}")
        if self.dtype != "float32" and self.metric != "perplexity":
            raise ValueError(f"eval.dtype = {self.dtype!r} applies to metric = 'perplexity', got metric "
                             f"{self.metric!r}")
        if self.windows not in WINDOW_ORDERS:
            raise ValueError(f"eval.windows {self.windows!r} unknown; known: {', '.join(WINDOW_ORDERS)}")
        if self.bos not in BOS_MODES:
            raise ValueError(f"eval.bos {self.bos!r} unknown; known: {', '.join(BOS_MODES)}")
        if self.datasets is not None:
            object.__setattr__(self, "datasets", _check_datasets("eval.datasets", self.datasets))
            if self.metric != "perplexity":
                raise ValueError(f"eval.datasets applies to metric = 'perplexity', got metric {self.metric!r}")
            if self.dataset not in ("wikitext2", self.datasets[0]):  # the default, or said twice
                raise ValueError(f"eval.dataset {self.dataset!r} and eval.datasets {list(self.datasets)} disagree: "
                                 "the first of datasets is the main one; drop dataset")
            object.__setattr__(self, "dataset", self.datasets[0])

    def domains(self) -> tuple[str, ...]:
        """The datasets every run is evaluated on, the main one first."""
        return self.datasets if self.datasets is not None else (self.dataset,)

    def unbounded(self) -> EvalProtocol:
        return dataclasses.replace(self, max_windows=None, max_tokens=None, lm_eval_limit=None)


def _check_lm_eval(e: EvalProtocol) -> None:
    """[eval] lm_eval_*: task names as a tuple of distinct strings, for causal LMs; counts are positive."""
    tasks = e.lm_eval_tasks
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)) or not all(
            isinstance(t, str) and t for t in tasks):
        raise ValueError(f"eval.lm_eval_tasks must be a list of lm-eval task names, e.g. [\"wikitext_local\"], "
                         f"got {tasks!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"eval.lm_eval_tasks {list(tasks)} repeats a task")
    object.__setattr__(e, "lm_eval_tasks", tuple(tasks))
    if tasks and e.metric != "perplexity":
        raise ValueError(f"eval.lm_eval_tasks applies to causal LMs (metric = 'perplexity'), got metric {e.metric!r}")
    check_int("eval.lm_eval_limit", e.lm_eval_limit, 1, MAX_WINDOWS, allow_none=True)
    check_int("eval.lm_eval_max_length", e.lm_eval_max_length, 2, MAX_SEQ_LEN, allow_none=True)
    check_int("eval.lm_eval_batch_size", e.lm_eval_batch_size, 1, MAX_BATCH)


@dataclass(frozen=True)
class CalibrationProtocol:
    """Seeded random windows for methods that need data. Never the test split."""

    dataset: str = "wikitext2"
    split: str = "validation"
    num_samples: int = 128
    seq_len: int = 512
    # mixed-domain calibration: num_samples windows shared among these (the `split` of each: pystdlib's
    # "validation" is its calibration part), in proportion to `mix` (default equal shares); None: `dataset`
    datasets: tuple[str, ...] | None = None
    mix: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.split == "test":
            raise ValueError("calibration.split = 'test' is not allowed: never calibrate on the evaluation split")
        check_int("calibration.num_samples", self.num_samples, 1, MAX_CALIB_SAMPLES)
        check_int("calibration.seq_len", self.seq_len, 1, MAX_SEQ_LEN)
        if self.datasets is not None:
            object.__setattr__(self, "datasets", _check_datasets("calibration.datasets", self.datasets))
            if self.dataset not in ("wikitext2", self.datasets[0]):
                raise ValueError(f"calibration.dataset {self.dataset!r} and calibration.datasets "
                                 f"{list(self.datasets)} disagree: drop dataset")
            object.__setattr__(self, "dataset", self.datasets[0])
        if self.mix is not None:
            mix = self.mix
            if (not isinstance(mix, (list, tuple)) or len(mix) != len(self.domains())
                    or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 for w in mix)):
                raise ValueError(f"calibration.mix must be one positive weight per dataset of calibration.datasets "
                                 f"({len(self.domains())}), got {mix!r}")
            object.__setattr__(self, "mix", tuple(mix))
        if self.num_samples < len(self.domains()):
            raise ValueError(f"calibration.num_samples = {self.num_samples} cannot give each of "
                             f"{len(self.domains())} datasets a window")

    def domains(self) -> tuple[str, ...]:
        return self.datasets if self.datasets is not None else (self.dataset,)


def _check_datasets(field: str, datasets) -> tuple[str, ...]:
    """A non-empty list of known datasets (or text files) whose column names (domain_label) differ."""
    if isinstance(datasets, str) or not isinstance(datasets, (list, tuple)) or not datasets:
        raise ValueError(f"{field} must be a non-empty list of datasets, e.g. [\"wikitext2\", \"pystdlib\"], "
                         f"got {datasets!r}")
    for d in datasets:
        check_dataset(field, d)
    labels = [domain_label(d) for d in datasets]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"{field}: {', '.join(dupes)} named twice (a file is named by its stem)")
    return tuple(datasets)


@dataclass(frozen=True)
class ExecutionConfig:
    """How runs execute (never part of a run's key): per-run resources for `--executor ray`, and processes
    for data-parallel QAT."""

    num_cpus: float = 1  # per run (Ray task); also its torch threads
    num_gpus: float = 0
    max_retries: int = 1  # a dead worker's run is retried this many times
    qat_processes: int = 1
    # block-walking methods quantize a copy that shares the float model's blocks until it reaches each
    # (calibration/streaming.py): bitwise the same codes, about one model's weights less memory; false: a full copy
    stream_blocks: bool = True

    def __post_init__(self):
        for name in ("num_cpus", "num_gpus"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"execution.{name} must be a number >= 0, got {v!r}")
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError("execution: num_cpus and num_gpus are both 0; a run needs some resource")
        check_int("execution.max_retries", self.max_retries, 0)
        check_int("execution.qat_processes", self.qat_processes, 1, MAX_PROCESSES)
        if not isinstance(self.stream_blocks, bool):
            raise ValueError(f"execution.stream_blocks must be true or false, got {self.stream_blocks!r}")
