"""lm-evaluation-harness on the model in memory (quantlab/eval/lmeval.py) and the offline `wikitext_local` task.

Reference for the perplexities: quantlab's own total NLL over the documents (window_log_probs on lm-eval's rolling
windows, rebuilt here from their definition) / the documents' words or bytes, to 1e-4 relative.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

import quantlab
from quantlab.eval.perplexity import window_log_probs

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is missing; pip install 'quantlab[lmeval]'")

from quantlab.eval import lmeval  # noqa: E402
from quantlab.eval.lmeval import check_tasks, run_lm_eval, task_manager, wikitext_documents  # noqa: E402

# hub-format rows (a title / text line keeps its "\n", a blank line is ""): three pages, one with a section heading
WORDS = ("the quick brown fox jumps over the lazy dog . quantization maps floats to a small grid of integers . "
         "perplexity measures how surprised a language model is by held @-@ out text , says \" someone \" . ").split()


def _rows() -> list[str]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for title, n_words in (("Alpha", 90), ("Beta", 240), ("Gamma", 40)):
        picks = torch.randint(0, len(WORDS), (n_words,), generator=gen).tolist()
        text = " ".join(WORDS[i] for i in picks)
        rows += ["", f" = {title} = \n", "", f" {text[:len(text) // 2]} \n", "", " = = Section = = \n", "",
                 f" {text[len(text) // 2:]} \n"]
    return rows + [""]


@pytest.fixture(scope="module")
def tiny_data_dir(tmp_path_factory):
    """A WikiText-2 directory whose test split is three short pages."""
    out = tmp_path_factory.mktemp("wikitext-tiny")
    (out / "wiki.test.rows.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in _rows()))
    (out / "wiki.valid.tokens").write_text(" ".join(WORDS * 20) + "\n")
    return out


def rolling_nll(model, ids: list[int], max_length: int, prefix: int) -> float:
    """Total NLL of `ids` on lm-eval's rolling windows, each scored by quantlab's window_log_probs: the first window
    is [prefix] + ids[:L-1] and predicts ids[:L]; each later one predicts the next <= L tokens, seeing the L tokens
    before each of them (a short last window keeps a full L-token context)."""
    total, done, n = 0.0, 0, len(ids)
    while done < n:
        end = min(done + max_length, n)
        inputs = [prefix] + ids[:end - 1] if done == 0 else ids[end - max_length - 1:end - 1]
        targets = torch.tensor(ids[done:end])
        logp = window_log_probs(model, torch.tensor(inputs))[-len(targets):]  # (k, V)
        total -= logp.gather(1, targets[:, None]).sum().item()
        done = end
    return total


def quantlab_wikitext_metrics(model, tok, pages: list[str], max_length: int, prefix: int) -> dict:
    """word / byte perplexity and bits per byte of `pages` as lm-eval's wikitext task defines them: the NLL of the
    detokenized page, over the words (whitespace runs split) and UTF-8 bytes of the original page."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    nll = sum(rolling_nll(model, tok(wikitext_detokenizer({"page": p}))["input_ids"], max_length, prefix)
              for p in pages)
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    nbytes = sum(len(p.encode("utf-8")) for p in pages)
    return {"word_perplexity": math.exp(nll / words), "byte_perplexity": math.exp(nll / nbytes),
            "bits_per_byte": nll / nbytes / math.log(2)}


def test_documents_are_grouped_at_level_one_titles():
    rows = ["", " = A = \n", "", " a . \n", "", " = = S = = \n", " = B = \n", " b \n", ""]
    assert wikitext_documents(rows) == [" = A = \n \n a . \n \n = = S = = ", " = B = \n b \n \n"]
    assert wikitext_documents(_rows())[1].startswith(" = Beta = \n \n")


def test_real_test_split_gives_the_document_level_sets_62_pages(wikitext_dir):
    rows, _ = lmeval.read_wikitext_test_rows(wikitext_dir)
    pages = wikitext_documents(rows)
    # EleutherAI/wikitext_document_level, wikitext-2-raw-v1, test: 62 rows; every page opens with its title line
    assert len(pages) == 62
    assert pages[0].startswith(" = Robert Boulter = \n") and pages[-1].endswith("Eddie Pelkey . \n \n")
    assert all(re.match(r" = [^=].* = \n", p) for p in pages)
    # nothing is lost but the blank line before the first title: the pages joined back are the rows' lines
    lines, joined = "\n".join([r[:-1] if r else " " for r in rows] + [""]), "\n".join(pages)
    assert lines.endswith(joined) and not lines[: len(lines) - len(joined)].strip()


@pytest.mark.parametrize("spec", [None, {"method": "rtn", "bits": 4, "group_size": 32}])
def test_word_perplexity_equals_quantlabs_own_rolling_nll(tiny_model_dir, tiny_data_dir, spec):
    model, tok = quantlab.load_model(str(tiny_model_dir), device="cpu")
    if spec is not None:  # a quantized model, evaluated as it is in memory
        quantlab.quantize(model, quantlab.make_config(spec))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cols = run_lm_eval(model, tok, ["wikitext_local"], max_length=64, data_dir=tiny_data_dir)
    pages = wikitext_documents(json.loads(r)["text"] for r in (tiny_data_dir / "wiki.test.rows.jsonl").open())
    assert cols["lmeval_wikitext_local_docs"] == len(pages) == 3
    assert cols["lmeval_max_length"] == 64 and cols["lmeval_prefix_token_id"] == tok.bos_token_id
    assert cols["lmeval_document_bos"] is False  # this tokenizer adds no BOS: the prefix is the only one
    ref = quantlab_wikitext_metrics(model, tok, pages, 64, tok.bos_token_id)
    for metric, value in ref.items():  # reference: quantlab's NLL on the same windows; 1e-4 relative
        assert cols[f"lmeval_wikitext_local_{metric}"] == pytest.approx(value, rel=1e-4), metric
        assert cols[f"lmeval_wikitext_local_{metric}_stderr"] is None  # lm-eval does not bootstrap these
    assert json.loads(cols["lmeval_higher_is_better"])["lmeval_wikitext_local_word_perplexity"] is False
    # the model and tokenizer are left as they were (HFLM ties weights and sets a pad token on what it gets)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and "tie_weights" not in vars(model)
    assert tok.pad_token is None


def test_quantized_weights_are_dequantized_once_and_gemms_agree(tiny_model_dir, tiny_data_dir, monkeypatch):
    """run_lm_eval evaluates a simulated model at float speed: each QuantLinear computes its weight once for the
    whole evaluation (not once per forward), and oneDNN's GEMM gives PyTorch's result to 1e-6 relative."""
    from quantlab.core.qlinear import QuantLinear
    from quantlab.eval.gemm import onednn_available

    model, tok = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(model, quantlab.make_config({"method": "rtn", "bits": 4, "group_size": 32}))
    n_layers = sum(isinstance(m, QuantLinear) for m in model.modules())
    calls = []
    weight = QuantLinear._weight
    monkeypatch.setattr(QuantLinear, "_weight", lambda self, dtype: calls.append(self) or weight(self, dtype))
    aten = run_lm_eval(model, tok, ["wikitext_local"], max_length=64, data_dir=tiny_data_dir, gemm="aten")
    assert aten["lmeval_gemm"] == "aten"
    assert len(calls) == n_layers > 0  # many rolling windows (3 pages of 64-token windows), one dequant per layer
    assert all(m.weight_cache is None for m in model.modules() if isinstance(m, QuantLinear))  # freed after
    if onednn_available():
        fast = run_lm_eval(model, tok, ["wikitext_local"], max_length=64, data_dir=tiny_data_dir, gemm="onednn")
        assert fast["lmeval_gemm"] == "onednn"
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            key = f"lmeval_wikitext_local_{metric}"
            assert fast[key] == pytest.approx(aten[key], rel=1e-6), metric


def test_document_bos_says_when_the_tokenizer_adds_its_own(tiny_model_dir):
    from tokenizers.processors import TemplateProcessing

    model, tok = quantlab.load_model(str(tiny_model_dir), device="cpu")
    assert lmeval.document_bos(lmeval.wrap_model(model, tok)) is False
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    assert lmeval.document_bos(lmeval.wrap_model(model, tok)) is True


def test_a_hub_task_offline_fails_naming_it(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    (tmp_path / "hub_only.yaml").write_text(
        "task: hub_only_task\ndataset_path: quantlab-tests/not-in-any-cache\noutput_type: loglikelihood\n"
        "test_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: ' x'\nmetric_list:\n  - metric: acc\n")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 sets them
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"'hub_only_task' needs the Hugging Face hub .*'quantlab-tests/not-in-any-"
                                           r"cache'.*HF_DATASETS_OFFLINE.*Offline tasks: wikitext_local"):
        check_tasks(["hub_only_task"], include_path=[tmp_path])
    local = task_manager(["wikitext_local"])  # lm-eval's own registry is not indexed (~10 s) for a name check
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) 'wikitext_locl'; offline here: wikitext_local"):
        check_tasks(["wikitext_locl"], manager=local)


def test_wikitext_local_without_local_data_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(lmeval, "find_wikitext2_dir", lambda data_dir=None: None)
    with pytest.raises(FileNotFoundError, match="wikitext_local reads the local WikiText-2 test rows"):
        lmeval.local_wikitext_dataset()


def test_experiment_lm_eval_tasks_add_columns_and_a_report_table(tiny_model_dir, tiny_data_dir, tmp_path):
    from quantlab.runs.runner import run_experiment

    exp = quantlab.parse_experiment({
        "name": "tiny_lmeval", "model": str(tiny_model_dir), "device": "cpu",
        "run": [{"name": "fp32", "method": "none"}, {"name": "w4", "method": "rtn", "bits": 4, "group_size": 32}],
        "eval": {"seq_len": 32, "max_windows": 1, "kl_windows": 0, "latency": False,
                 "lm_eval_tasks": ["wikitext_local"], "lm_eval_limit": 2, "lm_eval_max_length": 64}})
    df = run_experiment(exp, tmp_path, data_dir=tiny_data_dir, progress=False).set_index("run")
    col = "lmeval_wikitext_local_word_perplexity"
    assert (df["lmeval_wikitext_local_docs"] == 2).all() and df[col].notna().all()
    assert df.loc["w4", col] != df.loc["fp32", col]  # each run's own model
    model, tok = quantlab.load_model(str(tiny_model_dir), device="cpu")
    pages = wikitext_documents(json.loads(r)["text"] for r in (tiny_data_dir / "wiki.test.rows.jsonl").open())[:2]
    ref = quantlab_wikitext_metrics(model, tok, pages, 64, tok.bos_token_id)["word_perplexity"]
    assert df.loc["fp32", col] == pytest.approx(ref, rel=1e-4)
    report = (tmp_path / "tiny_lmeval.md").read_text()
    assert "**lm-evaluation-harness**" in report and "| run | scheme | wikitext_local_word_perplexity ↓ |" in report
    assert "starting from token id 0." in report  # the tiny tokenizer's <s>; it adds no BOS of its own


def test_lm_eval_fields_are_validated():
    with pytest.raises(ValueError, match="lm_eval_tasks must be a list"):
        quantlab.parse_experiment({"model": "m", "run": [{"name": "a", "method": "none"}],
                                   "eval": {"lm_eval_tasks": "wikitext_local"}})
    with pytest.raises(ValueError, match="repeats a task"):
        quantlab.parse_experiment({"model": "m", "run": [{"name": "a", "method": "none"}],
                                   "eval": {"lm_eval_tasks": ["wikitext_local", "wikitext_local"]}})
    with pytest.raises(ValueError, match="causal LMs"):
        quantlab.parse_experiment({"model": "m", "run": [{"name": "a", "method": "none"}],
                                   "eval": {"metric": "embedding", "lm_eval_tasks": ["wikitext_local"]}})


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_word_perplexity_equals_quantlabs_own_on_the_first_document(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    # the first page (1407 tokens) in rolling windows of 512, the last one short with a full context. Two pages (the
    # second has 5349 tokens) at the model's 8192 pass too, but took 85-230 s on a 2-core CPU shared with other jobs
    limit, length = 1, 512
    cols = run_lm_eval(model, tok, ["wikitext_local"], limit=limit, max_length=length, data_dir=wikitext_dir)
    rows, _ = lmeval.read_wikitext_test_rows(wikitext_dir)
    ref = quantlab_wikitext_metrics(model, tok, wikitext_documents(rows)[:limit], length, cols["lmeval_prefix_token_id"])
    for metric, value in ref.items():  # reference: quantlab's NLL on the same windows; 1e-4 relative
        assert cols[f"lmeval_wikitext_local_{metric}"] == pytest.approx(value, rel=1e-4), metric
