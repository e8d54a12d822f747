"""lm-evaluation-harness on the model in memory (float or quantized): nothing is reloaded or requantized.

The model and its tokenizer are wrapped as lm-eval's `HFLM(pretrained=model, tokenizer=tok)`. Tasks come
from lm-eval's registry, plus quantlab's offline ones in lmeval_tasks/ (`wikitext_local`: lm-eval's
`wikitext` task on the local WikiText-2 test rows). Each task metric becomes a row column with lm-eval's
stderr beside it: `lmeval_<task>_<metric>` and `lmeval_<task>_<metric>_stderr` (None where lm-eval reports
none, e.g. the perplexities, which it does not bootstrap).

    cols = run_lm_eval(model, tok, ["wikitext_local"], limit=2)
    cols["lmeval_wikitext_local_word_perplexity"]

A task whose data set lives on the Hugging Face hub fails with a message naming it when the hub cannot be
reached (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, or no network), before any model is evaluated (check_tasks).
"""
from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path

from ..core.lifecycle import cached_weights
from ..models.data import WIKITEXT_FILES, candidate_data_dirs, find_wikitext2_dir
from .gemm import onednn_linear, resolve_gemm

TASKS_DIR = Path(__file__).with_name("lmeval_tasks")
LOCAL_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))  # offline tasks, one YAML each
DATA_DIR_KEY = "quantlab_data_dir"  # task metadata key: where the local tasks read their data
PREFIX = "lmeval_"
# exceptions in a failed task load that mean "the data set is on the hub and the hub is out of reach"
_HUB_ERRORS = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "ConnectTimeout")


def import_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise ImportError("lm-eval tasks need lm-evaluation-harness, which is not installed: "
                          "pip install 'quantlab[lmeval]' (bash scripts/setup.sh installs it)") from None
    return lm_eval


# -- the local WikiText-2 documents ------------------------------------------------------------------------------


def _is_page_title(line: str) -> bool:
    """A level-1 heading ` = Title = ` (`= = Section = =` and deeper are not), as the document-level loader
    tests it: `= =` runs collapsed to `==`, then `= ` ... ` =`."""
    rline = line.replace("= = =", "===").replace("= =", "==").strip()
    return rline.startswith("= ") and rline.endswith(" =")


def wikitext_documents(rows: list[str]) -> list[str]:
    """The hub's WikiText-2 rows (one per raw-file line, "\\n" kept, blank lines "") -> document pages.

    Rebuilds the raw file's lines (a blank line is " " in WikiText's raw files; the rows keep only "") and
    groups them as EleutherAI/wikitext_document_level does: a page starts at each level-1 title line, the
    lines of a page are joined with "\\n", text before the first title is dropped when blank, and the last
    page keeps the file's final newline. The test split gives 62 pages.

    >>> wikitext_documents(["", " = A = \\n", "", " a . \\n", "", " = = S = = \\n", " = B = \\n", " b \\n"])
    [' = A = \\n \\n a . \\n \\n = = S = = ', ' = B = \\n b \\n']
    """
    lines = [row[:-1] if row.endswith("\n") else (row or " ") for row in rows] + [""]
    pages, current = [], []
    for line in lines:
        if _is_page_title(line):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return pages


def read_wikitext_test_rows(data_dir: str | Path | None = None) -> tuple[list[str], Path]:
    """The local WikiText-2 test rows (wiki.test.rows.jsonl), found as quantlab.models.data finds them."""
    local = find_wikitext2_dir(data_dir)
    if local is None:
        raise FileNotFoundError(
            f"lm-eval task wikitext_local reads the local WikiText-2 test rows and found none (looked in "
            f"{', '.join(str(p) for p in candidate_data_dirs())}); pass --data-dir or set QUANTLAB_DATA_DIR to a "
            f"directory with {WIKITEXT_FILES['test']} (with the hub reachable, lm-eval's own `wikitext` task needs no "
            f"local files)")
    path = local / WIKITEXT_FILES["test"]
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f], path


def local_wikitext_dataset(data_dir: str | Path | None = None):
    """{"test": Dataset with a `page` column}: what lm-eval's `wikitext` task loads from the hub, built locally."""
    import datasets

    rows, _ = read_wikitext_test_rows(data_dir)
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": wikitext_documents(rows)})})


# -- tasks ---------------------------------------------------------------------------------------------------------


def task_manager(tasks: list[str], data_dir: str | Path | None = None, include_path: list | None = None):
    """An lm-eval TaskManager that knows quantlab's local tasks (and `include_path` folders of task YAMLs); lm-eval's
    own registry (~10 s to index) is added only when a task is not among those."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + [str(p) for p in include_path or []]
    meta = {DATA_DIR_KEY: str(data_dir)} if data_dir is not None else None
    local = TaskManager(include_path=paths, include_defaults=False, metadata=meta)
    if all(t in local.all_tasks for t in tasks):
        return local
    return TaskManager(include_path=paths, include_defaults=True, metadata=meta)


def _needs_hub(error: BaseException) -> bool:
    while error is not None:
        if type(error).__name__ in _HUB_ERRORS:
            return True
        error = error.__cause__ or error.__context__
    return False


def check_tasks(tasks: list[str], data_dir=None, include_path=None, manager=None):
    """Build every task once (lm-eval loads its data set here) and return the TaskManager; before any model runs.

    Unknown names and tasks whose data set is on an unreachable hub fail with a message naming the task."""
    if not tasks:
        raise ValueError("no lm-eval tasks given")
    manager = manager or task_manager(tasks, data_dir, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(map(repr, unknown))}; offline here: "
                         f"{', '.join(LOCAL_TASKS)}; lm-eval's own tasks are listed by `lm_eval ls tasks`")
    for name in tasks:
        try:
            manager.load([name])
        except Exception as e:
            if not _needs_hub(e):
                raise
            source = manager.task_index[name].cfg.get("dataset_path") if name in manager.task_index else None
            raise RuntimeError(
                f"lm-eval task {name!r} needs the Hugging Face hub for its data set"
                f"{f' {source!r}' if source else ''}, which cannot be reached here (HF_DATASETS_OFFLINE / "
                f"HF_HUB_OFFLINE set, or no network; {type(e).__name__}: {e}). Offline tasks: "
                f"{', '.join(LOCAL_TASKS)}; run {name!r} where the hub is reachable (it is cached after the first "
                f"download)") from None
    return manager


# -- evaluation ----------------------------------------------------------------------------------------------------


def wrap_model(model, tokenizer, max_length: int | None = None, batch_size: int = 1):
    """lm-eval's HFLM around the model in memory. HFLM calls model.tie_weights() and may give the tokenizer a
    pad token: the model is taken as it is (a quantized or untied head stays so) and the tokenizer is a copy."""
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    model.tie_weights = lambda *args, **kwargs: None  # an instance attribute, removed below
    try:
        return HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), backend="causal", max_length=max_length,
                    batch_size=batch_size)
    finally:
        del model.tie_weights


def evaluate(model, tokenizer, tasks: list[str], limit: int | None = None, max_length: int | None = None,
             batch_size: int = 1, data_dir=None, include_path=None, manager=None) -> tuple[dict, dict]:
    """lm-eval's simple_evaluate on the model in memory: (its results dict, {max_length: the rolling-window
    length, prefix_token_id: the token each document's first window starts from, document_bos: whether lm-eval's
    encoding of a document starts with the tokenizer's BOS, which is then scored as a predicted token})."""
    import_lm_eval()
    from lm_eval import simple_evaluate

    lm = wrap_model(model, tokenizer, max_length, batch_size)
    manager = manager or task_manager(tasks, data_dir, include_path)
    results = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=False)
    return results, {"max_length": lm.max_length, "prefix_token_id": lm.prefix_token_id,
                     "document_bos": document_bos(lm)}


def document_bos(lm) -> bool:
    """Whether lm-eval's encoding of a document starts with the tokenizer's BOS (Gemma's, Llama's tokenizers add
    one): lm-eval then scores it as a predicted token, the first window being [prefix, BOS, text...]."""
    bos = lm.tokenizer.bos_token_id
    return bos is not None and lm.tok_encode("x")[:1] == [bos]


def column(task: str, metric: str) -> str:
    """`lmeval_<task>_<metric>`, e.g. lmeval_wikitext_local_word_perplexity."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", f"{PREFIX}{task}_{metric}")


def result_columns(results: dict) -> dict:
    """Row columns from simple_evaluate's results: each task metric and its stderr (None where lm-eval has
    none: "N/A"), the documents evaluated per task, and which way each metric is better."""
    cols, better = {}, {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            name = column(task, metric if filt == "none" else f"{metric}_{filt}")
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            cols[name] = value
            cols[f"{name}_stderr"] = stderr if isinstance(stderr, (int, float)) else None
            hib = results.get("higher_is_better", {}).get(task, {}).get(metric)
            if hib is not None:
                better[name] = bool(hib)
        if task in results.get("n-samples", {}):
            cols[column(task, "docs")] = results["n-samples"][task]["effective"]
    cols[f"{PREFIX}higher_is_better"] = json.dumps(better, sort_keys=True)
    return cols


def run_lm_eval(model, tokenizer, tasks: list[str], limit: int | None = None, max_length: int | None = None,
                batch_size: int = 1, data_dir=None, include_path=None, manager=None, gemm: str = "auto") -> dict:
    """Evaluate `tasks` on the model in memory and return the row columns (see result_columns), with the
    protocol: lmeval_tasks, lmeval_limit, lmeval_max_length (rolling-window length), lmeval_prefix_token_id,
    lmeval_document_bos, lmeval_batch_size, lmeval_gemm, lmeval_version, lmeval_s.

    As quantlab's own perplexity pass: each quantized weight is dequantized once for the whole evaluation
    (cached_weights: bitwise the same forward), and gemm "auto" runs fp32 CPU linears through oneDNN
    on an AMD CPU (eval/gemm.py; "aten" keeps PyTorch's BLAS, as "auto" does elsewhere)."""
    from importlib.metadata import version

    gemm = resolve_gemm(gemm, next(model.parameters()).device)
    t0 = time.perf_counter()
    with cached_weights(model), onednn_linear(gemm == "onednn"):
        results, used = evaluate(model, tokenizer, tasks, limit, max_length, batch_size, data_dir, include_path,
                                 manager)
    return {**result_columns(results), f"{PREFIX}tasks": ",".join(tasks), f"{PREFIX}limit": limit,
            **{f"{PREFIX}{k}": v for k, v in used.items()}, f"{PREFIX}batch_size": batch_size, f"{PREFIX}gemm": gemm,
            f"{PREFIX}version": version("lm_eval"), f"{PREFIX}s": time.perf_counter() - t0}
