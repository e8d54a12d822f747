"""The importance matrix (imatrix) as llama.cpp's llama-imatrix computes and stores it.

For every linear, llama-imatrix (tools/imatrix/imatrix.cpp, collect_imatrix) adds up the square of each input
column over every calibration token, Σ x², and counts the tokens; llama-quantize divides the two, in_sum2 / count,
and hands that (K,) vector to the quantizer as the weight of each input column (quant_weights).

    entries = collect_imatrix(model, batches)                 # {"model.layers.0.self_attn.v_proj": ImatrixEntry}
    save_imatrix("imatrix.gguf", entries, gguf_tensor_names(model), datasets=["wiki.train"], chunk_size=512)
    importance = load_imatrix("imatrix.gguf")                 # {"blk.0.attn_v.weight": (K,) float32}
    check_imatrix(importance, {"blk.0.attn_v.weight": 576, ...})

Files: the GGUF format imatrix.cpp writes now (save_imatrix) and the legacy binary .dat format (read only) that
common/imatrix-loader.cpp still reads. Dense models only: one count per tensor (llama.cpp keeps one per expert).
"""
from __future__ import annotations

import fnmatch
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.ggml import names
from ..core.qlinear import QuantLinear

# imatrix.cpp's metadata keys (common/imatrix-loader.h) and tensor name suffixes
KEY_TYPE, IMATRIX_TYPE = "general.type", "imatrix"
KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
SUM_SUFFIX, COUNT_SUFFIX = ".in_sum2", ".counts"


@dataclass(frozen=True)
class ImatrixEntry:
    """One linear's statistics: in_sum2 (K,) float32, Σ x² of each input column over `count` tokens."""

    in_sum2: torch.Tensor
    count: int

    @property
    def importance(self) -> torch.Tensor:
        """in_sum2 / count, in float32 as llama-quantize divides (its load_imatrix)."""
        return self.in_sum2 / torch.tensor(float(self.count), dtype=torch.float32)


def _selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    hit = any(fnmatch.fnmatchcase(name, p) for p in include)
    return hit and not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def collect_imatrix(model: nn.Module, batches: Iterable, include: Sequence[str] = ("*",),
                    exclude: Sequence[str] = ("lm_head",), progress: bool = True) -> dict[str, ImatrixEntry]:
    """Σ x² and the token count of every selected nn.Linear's input, over all batches (input_ids tensors or dicts
    of forward kwargs). Every row the linear sees counts, padding included: pass unpadded chunks, as llama-imatrix
    does. lm_head is left out by default, as llama-imatrix leaves out output.weight without --process-output.
    Not ported: llama-imatrix's skip of matmuls over fewer than 16 tokens (it meets those only when generating).

    Sums are accumulated in float64 and rounded to float32 once at the end: llama.cpp adds token by token in
    float32, whose result depends on the order of the additions (and loses ~1e-4 relative over 10⁵ tokens);
    float64 makes the stored float32 the correctly rounded sum, whatever the batching.

    >>> entries = collect_imatrix(model, [input_ids], progress=False)   # doctest: +SKIP
    >>> entries["model.layers.0.mlp.down_proj"].importance.shape          # doctest: +SKIP
    torch.Size([8960])
    """
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, nn.Linear | QuantLinear) and _selected(n, include, exclude)}
    if not linears:
        raise ValueError(f"no nn.Linear matches include={list(include)} exclude={list(exclude)}")
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(linears, 0)

    def hook_for(name: str):
        def pre(_module, args):
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1]).to(torch.float64)  # (tokens, K)
            total = rows.square().sum(0)
            sums[name] = total if name not in sums else sums[name] + total
            counts[name] += rows.shape[0]
        return pre

    device = next(model.parameters()).device
    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in tqdm(batches, desc="imatrix", disable=not progress, leave=False):
                if isinstance(batch, Mapping):
                    model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
                else:
                    model(batch.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {n: ImatrixEntry(sums[n].to(torch.float32).cpu(), counts[n]) for n in linears if counts[n] > 0}


def gguf_tensor_names(model: nn.Module) -> dict[str, str]:
    """HF linear name -> GGUF tensor name ("model.layers.0.self_attn.v_proj" -> "blk.0.attn_v.weight") for every
    linear (nn.Linear or QuantLinear) of a llama, qwen2 or gemma3 model (core/ggml/names.py).

    >>> gguf_tensor_names(model)["model.layers.0.mlp.down_proj"]   # doctest: +SKIP
    'blk.0.ffn_down.weight'
    """
    cfg = model.config
    return {n: names.to_gguf_name(f"{n}.weight", cfg.model_type, cfg.num_hidden_layers)
            for n, m in model.named_modules() if isinstance(m, nn.Linear | QuantLinear)}


def save_imatrix(path: str | Path, entries: Mapping[str, ImatrixEntry], name_map: Mapping[str, str],
                 datasets: Sequence[str], chunk_size: int, chunk_count: int | None = None) -> Path:
    """Write entries as llama-imatrix's GGUF file: general.type "imatrix", imatrix.datasets (strings),
    imatrix.chunk_count and imatrix.chunk_size (uint32), and per tensor, in sorted name order,
    "<gguf name>.in_sum2" F32 (K,) and "<gguf name>.counts" F32 (1,); byte for byte the file libggml writes from
    imatrix.cpp's calls (tests/test_imatrix.py). chunk_size: tokens per calibration
    chunk; chunk_count: how many chunks (default: the largest count // chunk_size, as llama-imatrix computes it).

    >>> save_imatrix("imatrix.gguf", entries, gguf_tensor_names(model), ["wiki.train"], chunk_size=512)  # doctest: +SKIP
    """
    if not datasets or not all(isinstance(d, str) for d in datasets):
        raise ValueError(f"datasets must name at least one calibration text (llama-quantize refuses an imatrix "
                         f"without imatrix.datasets), got {datasets!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    unmapped = sorted(set(entries) - set(name_map))
    if unmapped:
        raise ValueError(f"no GGUF tensor name for {', '.join(unmapped[:5])}{' ...' if len(unmapped) > 5 else ''}; "
                         f"name_map knows {len(name_map)} linears (see gguf_tensor_names)")
    if chunk_count is None:
        chunk_count = max((e.count for e in entries.values()), default=0) // chunk_size
    by_gguf = {name_map[n]: e for n, e in entries.items()}
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch="")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # imatrix.cpp writes none (arch "": not added)
    writer.add_string(KEY_TYPE, IMATRIX_TYPE)
    writer.add_array(KEY_DATASETS, list(datasets))
    writer.add_uint32(KEY_CHUNK_COUNT, chunk_count)
    writer.add_uint32(KEY_CHUNK_SIZE, chunk_size)
    for name in sorted(by_gguf):
        entry = by_gguf[name]
        # imatrix.cpp makes ggml_new_tensor_2d(K, 1) and (1, 1); gguf stores ggml_n_dims of them, which drops the
        # trailing 1: one dimension, ne (K,) and (1,)
        writer.add_tensor(name + SUM_SUFFIX, entry.in_sum2.detach().cpu().to(torch.float32).numpy().reshape(-1))
        writer.add_tensor(name + COUNT_SUFFIX, np.array([entry.count], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class ImatrixFile:
    """What an imatrix file holds: per GGUF tensor name the sums (K·n_mat,) float32 and counts (n_mat,) int64 as
    llama.cpp's common_imatrix_load returns them; legacy: the sums are (Σx²/count)·ncall and counts [ncall]."""

    sums: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]
    datasets: list[str]
    chunk_count: int
    chunk_size: int
    legacy: bool


def _corrupt(path: Path, why: str) -> ValueError:
    return ValueError(f"imatrix file {path} is not a valid llama.cpp imatrix: {why}")


def _read_gguf(path: Path) -> ImatrixFile:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the gguf package raises ValueError, IndexError, ... on a broken file
        raise _corrupt(path, f"cannot parse it as GGUF ({type(e).__name__}: {e})") from None
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in reader.fields]
    if missing:  # llama-quantize's load_imatrix refuses it the same way
        raise _corrupt(path, f"missing imatrix metadata {', '.join(missing)}")
    tensors = {t.name: t for t in reader.tensors}
    if not tensors:
        raise _corrupt(path, "no tensors")
    sums, counts = {}, {}
    for full, t in tensors.items():
        for suffix, out in ((SUM_SUFFIX, sums), (COUNT_SUFFIX, counts)):
            if full.endswith(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise _corrupt(path, f"{full} is {t.tensor_type.name}; sums and counts must be F32")
                out[full.removesuffix(suffix)] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    unpaired = sorted(set(sums) ^ set(counts))
    if unpaired:
        raise _corrupt(path, f"mismatched sums and counts for {', '.join(unpaired)}")
    counts = {n: torch.tensor([round(float(c)) for c in v], dtype=torch.int64) for n, v in counts.items()}
    for name, s in sums.items():
        if len(counts[name]) == 0 or s.numel() % len(counts[name]):
            raise _corrupt(path, f"{name}: {s.numel()} sums do not split into {len(counts[name])} counts")
    field = reader.fields
    return ImatrixFile(sums, counts, [str(d) for d in field[KEY_DATASETS].contents()],
                       int(field[KEY_CHUNK_COUNT].contents()), int(field[KEY_CHUNK_SIZE].contents()), legacy=False)


class _Cursor:
    """Little-endian reads over bytes that name the file and the field when the bytes run out."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _corrupt(self.path, f"the file ends inside {what} (byte {self.pos} of {len(self.data)})")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _read_legacy(path: Path, data: bytes) -> ImatrixFile:
    """imatrix.cpp's save_imatrix_legacy layout: int32 n_entries; per entry int32 name length, the name, int32
    ncall, int32 nval, nval float32 (Σx²/count·ncall); then optionally int32 chunk count, int32 length, dataset."""
    cur = _Cursor(path, data)
    n_entries = cur.i32("the entry count")
    if n_entries < 1:
        raise _corrupt(path, f"no data (entry count {n_entries})")
    sums, counts = {}, {}
    for i in range(n_entries):
        where = f"entry {i + 1} of {n_entries}"
        raw_name = cur.take(cur.i32(f"{where}'s name length"), f"{where}'s name")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise _corrupt(path, f"{where}'s name is not UTF-8") from None
        ncall, nval = cur.i32(f"{where}'s ncall"), cur.i32(f"{where}'s value count")
        if nval < 1:
            raise _corrupt(path, f"{where} ({name}) has {nval} values")
        sums[name] = torch.from_numpy(np.frombuffer(cur.take(4 * nval, f"{where}'s values"), dtype="<f4").copy())
        counts[name] = torch.tensor([ncall], dtype=torch.int64)
    chunk_count, datasets = 0, []
    if cur.pos + 4 <= len(data):  # the trailing chunk count and dataset name are optional
        chunk_count = cur.i32("the chunk count")
        if cur.pos + 4 <= len(data):
            length = cur.i32("the dataset name length")
            if 0 < length <= len(data) - cur.pos:
                datasets.append(cur.take(length, "the dataset name").decode("utf-8", errors="replace"))
    return ImatrixFile(sums, counts, datasets, chunk_count, 0, legacy=True)


def read_imatrix(path: str | Path) -> ImatrixFile:
    """An imatrix file's raw contents, GGUF or legacy .dat (told apart by the GGUF magic, as llama.cpp falls back
    to the legacy reader when gguf_init fails). FileNotFoundError / ValueError name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"imatrix file {path} does not exist")
    data = path.read_bytes()
    if data[:4] == b"GGUF":
        return _read_gguf(path)
    return _read_legacy(path, data)


def load_imatrix(path: str | Path) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> importance (K,) float32, as llama-quantize's load_imatrix computes it: GGUF sums / count
    per expert (1 where the count is 0), legacy values / ncall (as stored where ncall is 0).

    >>> load_imatrix("imatrix.gguf")["blk.0.attn_v.weight"].shape   # doctest: +SKIP
    torch.Size([576])
    """
    f = read_imatrix(path)
    out = {}
    for name, sums in f.sums.items():
        counts = f.counts[name]
        if f.legacy:
            out[name] = sums / torch.tensor(float(counts[0]), dtype=torch.float32) if counts[0] > 0 else sums.clone()
            continue
        per = sums.reshape(len(counts), -1)  # (n_mat, K)
        c = counts.to(torch.float32).unsqueeze(1)
        out[name] = torch.where(c > 0, per / c.clamp(min=1), torch.ones_like(per)).reshape(-1)
    bad = [n for n, v in out.items() if not torch.isfinite(v).all()]
    if bad:  # llama_model_quantize refuses these too
        raise _corrupt(Path(path), f"non-finite values in {', '.join(bad[:5])}")
    return out


def check_imatrix(importance: Mapping[str, torch.Tensor], tensors: Mapping[str, int]) -> list[str]:
    """Fail, naming the tensor, where the imatrix does not fit the model (tensors: GGUF name -> input features K):
    an entry for a tensor the model lacks, or of another length. Returns the model's tensors the imatrix does not
    cover (llama.cpp quantizes those without one).

    >>> check_imatrix(load_imatrix("other-model.gguf"), {"blk.0.attn_v.weight": 576})  # doctest: +SKIP
    ValueError: imatrix entry blk.0.attn_v.weight has 960 values; the model's tensor has 576 input columns ...
    """
    if not importance:
        raise ValueError("the imatrix has no entries")
    for name, values in importance.items():
        if name not in tensors:
            raise ValueError(f"imatrix entry {name} is not a tensor of this model (an imatrix from another model?); "
                             f"the model has e.g. {', '.join(sorted(tensors)[:3])}")
        k = tensors[name]
        if values.numel() != k:
            raise ValueError(f"imatrix entry {name} has {values.numel()} values; the model's tensor has {k} input "
                             f"columns (an imatrix from another model?)")
    return sorted(set(tensors) - set(importance))


__all__ = ["ImatrixEntry", "ImatrixFile", "check_imatrix", "collect_imatrix", "gguf_tensor_names",
           "load_imatrix", "read_imatrix", "save_imatrix"]
