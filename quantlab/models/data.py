"""Evaluation and calibration text: WikiText-2 (local files or the hub), Python's standard library as source code
(`pystdlib`, models/pystdlib.py: a second domain every machine has) or any text file.

Protocol (stated in every row): the test split's rows joined with "\\n\\n" (the
GPTQ-paper string), tokenized once without special tokens (no BOS), cut into
non-overlapping windows. Calibration draws seeded random windows from the
validation split — never the test split. With [eval] bos = "prepend" (a model trained
to always see a BOS, such as Gemma) every window is the BOS and seq_len - 1 text tokens.

>>> ids, source = load_token_ids("wikitext2", "test", tokenizer)
>>> windows = eval_windows(ids, seq_len=512, max_windows=16)     # (16, 512)
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch

from ..util.checks import check_choice, read_utf8

DATASETS = ("pystdlib", "wikitext2")
SPLITS = ("test", "validation")
JOIN = "\n\n"
WIKITEXT_FILES = {"test": "wiki.test.rows.jsonl", "validation": "wiki.valid.tokens"}


def candidate_data_dirs() -> list[Path]:
    """Known places for wikitext-2 files: ../shared/data beside the repo or the working dir."""
    repo = Path(__file__).resolve().parents[2]
    return [repo.parent / "shared" / "data" / "wikitext-2", Path.cwd().parent / "shared" / "data" / "wikitext-2"]


def find_wikitext2_dir(data_dir: str | Path | None = None) -> Path | None:
    """The directory holding the wikitext-2 files, or None (then the hub is tried)."""
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"data directory {str(path)!r} does not exist")
        missing = [f for f in WIKITEXT_FILES.values() if not (path / f).exists()]
        if missing:
            raise FileNotFoundError(f"data directory {str(path)!r} lacks {', '.join(missing)}")
        return path
    return next((p for p in candidate_data_dirs() if (p / WIKITEXT_FILES["test"]).exists()), None)


def _hub_text(split: str) -> str:
    try:
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    except Exception as e:  # offline, no cache: say where the local files should be
        raise FileNotFoundError(
            f"wikitext2 {split!r} split: no local files found (looked in "
            f"{', '.join(str(p) for p in candidate_data_dirs())}) and the hub is unreachable ({e.__class__.__name__}). "
            "Pass --data-dir or set QUANTLAB_DATA_DIR to a directory with wiki.test.rows.jsonl and wiki.valid.tokens."
        ) from e
    return JOIN.join(rows)


def load_text(dataset: str, split: str, data_dir: str | Path | None = None) -> tuple[str, str]:
    """(text, source description). dataset is 'wikitext2', 'pystdlib' or a path to a UTF-8 text file."""
    if dataset == "pystdlib":
        from .pystdlib import pystdlib_text

        return pystdlib_text(split)
    if dataset not in DATASETS:
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"dataset {dataset!r} is neither a known dataset ({', '.join(DATASETS)}) nor a file")
        return read_utf8(path), f"file:{path.name}"
    check_choice("split", split, SPLITS)
    local = find_wikitext2_dir(data_dir)
    if local is None:
        return _hub_text(split), f"hub:wikitext-2-raw-v1/{split}"
    path = local / WIKITEXT_FILES[split]
    if split == "test":
        try:
            with path.open(encoding="utf-8") as f:
                rows = [json.loads(line)["text"] for line in f]
        except UnicodeDecodeError:
            read_utf8(path)  # raises, naming the file and the byte's offset in the file (not in a read chunk)
            raise
        return JOIN.join(rows), f"local:{path.name} rows joined with \\n\\n"
    return read_utf8(path), f"local:{path.name}"


def check_dataset(field: str, dataset) -> str:
    """`dataset` if it is a known dataset or an existing file, else a ValueError naming the known ones."""
    if not isinstance(dataset, str) or not dataset:
        raise ValueError(f"{field}: a dataset is a name or a file path, got {dataset!r}")
    if dataset not in DATASETS and not Path(dataset).is_file():
        raise ValueError(f"{field}: unknown dataset {dataset!r}; known: {', '.join(DATASETS)} (or the path of a "
                         "UTF-8 text file)")
    return dataset


def domain_label(dataset: str) -> str:
    """The name a dataset's columns carry (ppl_<label>): a known dataset's name, a text file's stem with every
    character other than a letter, digit or _ made _ ("data/my-code.txt" -> "my_code")."""
    if dataset in DATASETS:
        return dataset
    return re.sub(r"\W", "_", Path(dataset).stem, flags=re.ASCII) or "file"


def split_counts(total: int, weights) -> list[int]:
    """`total` windows shared out in proportion to `weights` (largest remainders, ties to the earlier entry).

    >>> split_counts(32, [1, 1]), split_counts(10, [2, 1])
    ([16, 16], [7, 3])
    """
    weights = [float(w) for w in weights]
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ident = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def tokenize(text: str, tokenizer, cache_dir: str | Path | None = None) -> torch.Tensor:
    """Token ids (N,) without special tokens; cached on disk as .npy when cache_dir is given."""
    cache = None
    if cache_dir is not None:
        key = hashlib.sha256(text.encode()).hexdigest()[:16] + "-" + _tokenizer_fingerprint(tokenizer)
        cache = Path(cache_dir) / "tokens" / f"{key}.npy"
        if cache.exists():
            return torch.from_numpy(np.load(cache, allow_pickle=False)).long()
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    arr = np.asarray(ids, dtype=np.int64)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npy")
        np.save(tmp, arr, allow_pickle=False)
        tmp.replace(cache)
    return torch.from_numpy(arr)


def load_token_ids(dataset: str, split: str, tokenizer, data_dir=None, cache_dir=None) -> tuple[torch.Tensor, str]:
    text, source = load_text(dataset, split, data_dir)
    if not text.strip():
        raise ValueError(f"dataset {dataset!r} split {split!r} is empty")
    return tokenize(text, tokenizer, cache_dir), source


BOS_MODES = ("none", "prepend")


def bos_token_id(tokenizer, bos: str) -> int | None:
    """The id every window starts with under `bos` ("prepend": the tokenizer's BOS), or None ("none").

    >>> bos_token_id(gemma_tokenizer, "prepend")
    2
    """
    check_choice("bos", bos, BOS_MODES)
    if bos == "none":
        return None
    if getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError(f"bos = 'prepend' needs a BOS token, but the tokenizer ({type(tokenizer).__name__}) has none; "
                         "use bos = 'none'")
    return int(tokenizer.bos_token_id)


def bos_description(tokenizer, bos: str, seq_len: int) -> str:
    """What a row's `bos` column says: "none", or which token starts every window and what that leaves."""
    bos_id = bos_token_id(tokenizer, bos)
    if bos_id is None:
        return "none"
    return f"`{tokenizer.bos_token}` (id {bos_id}) prepended to every window, {seq_len - 1} text tokens each"


def _with_bos(rows: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    if bos_id is None:
        return rows
    return torch.cat([torch.full((rows.shape[0], 1), bos_id, dtype=rows.dtype), rows], dim=1)


WINDOW_ORDERS = ("first", "spread")  # eval_windows: the first windows of the split, or evenly spaced ones


def eval_windows(
    ids: torch.Tensor, seq_len: int, max_windows: int | None = None, max_tokens: int | None = None,
    bos_id: int | None = None, order: str = "first",
) -> torch.Tensor:
    """Non-overlapping (n, seq_len) windows; the ragged tail is dropped (GPTQ protocol).

    order "first": the first n windows of the split; "spread": n of its windows at evenly spaced positions
    (window i of the k = max_windows is the round(i (N - 1) / (k - 1))-th of all N, the first and the last
    included), so a short budget samples the whole text rather than its beginning. Without a limit both are
    every window.
    bos_id: every window is that token followed by the next seq_len - 1 text tokens (windows still do not
    overlap, and every text token in them is predicted, the first one from the BOS).
    """
    if order not in WINDOW_ORDERS:
        raise ValueError(f"window order {order!r} unknown; known: {', '.join(WINDOW_ORDERS)}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    text_len = seq_len - (bos_id is not None)
    n = total = ids.numel() // text_len
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    windows = ids[: total * text_len].view(total, text_len)
    if order == "spread" and n < total:
        windows = windows[torch.linspace(0, total - 1, n).round().long()] if n > 1 else windows[:1]
    else:
        windows = windows[:n]
    return _with_bos(windows, bos_id)


def calibration_windows(ids: torch.Tensor, num_samples: int, seq_len: int, seed: int,
                        bos_id: int | None = None) -> torch.Tensor:
    """(num_samples, seq_len) windows at seeded random offsets (with replacement, GPTQ-style); with bos_id,
    that token followed by seq_len - 1 text tokens."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    text_len = seq_len - (bos_id is not None)
    if ids.numel() <= text_len:
        raise ValueError(f"calibration text has {ids.numel()} tokens; samples of seq_len={seq_len} need more")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - text_len, (num_samples,), generator=gen)
    return _with_bos(torch.stack([ids[s : s + text_len] for s in starts.tolist()]), bos_id)
