"""[eval] dtype = "bfloat16": perplexity and KL under bf16 autocast (quantlab/eval/perplexity.py), the float model's
float32 and bf16 perplexity in every row, the protocol line, and clear errors before any weights load."""
import math

import pytest
import torch

from quantlab.eval import perplexity
from quantlab.runs import runner
from quantlab.runs.experiment import EvalProtocol, parse_experiment

RUNS = [{"name": "fp32", "method": "none"}, {"name": "rtn", "method": "rtn", "bits": 4, "group_size": 32}]


def _windows(n=3, t=24):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(0))


def test_bf16_perplexity_is_the_autocast_loop_and_leaves_the_model_in_float32(tiny_model):
    model, _ = tiny_model
    windows = _windows()
    nll = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the reference: one window per forward
        for w in windows:
            logits = model(w[None]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
    ref = math.exp(nll / (3 * 23))
    fp32 = perplexity(model, windows, progress=False)
    bf16 = perplexity(model, windows, progress=False, dtype="bfloat16")
    assert bf16["ppl"] == pytest.approx(ref, rel=1e-4)  # bf16 matmuls: summation order differs with batching
    assert bf16["eval_dtype"] == "bfloat16" and bf16["eval_gemm"] == "aten" and "eval_dtype" not in fp32
    assert bf16["ppl"] != fp32["ppl"] and bf16["ppl"] == pytest.approx(fp32["ppl"], rel=2e-2)  # bf16, not fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert perplexity(model, windows, progress=False, dtype="float32")["ppl"] == fp32["ppl"]


def test_bad_eval_dtypes_are_named():
    with pytest.raises(ValueError, match="eval dtype 'float16' unknown; known: float32, bfloat16"):
        perplexity(torch.nn.Linear(2, 2), _windows(), dtype="float16")
    with pytest.raises(ValueError, match="gemm 'onednn' routes float32 linears only"):
        perplexity(torch.nn.Linear(2, 2), _windows(), dtype="bfloat16", gemm="onednn")
    with pytest.raises(ValueError, match="eval.dtype 'fp16' unknown; known: float32, bfloat16"):
        EvalProtocol(dtype="fp16")
    with pytest.raises(ValueError, match="eval.dtype = 'bfloat16' applies to metric = 'perplexity'"):
        EvalProtocol(dtype="bfloat16", metric="embedding")


def _raw(model_dir, eval_dtype="bfloat16", **top) -> dict:
    """The experiment file's table; eval_dtype None leaves [eval] dtype out (the default)."""
    e = {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3, "kl_windows": 2, "latency": False}
    return {"name": "tiny_bf16", "model": str(model_dir), "device": "cpu", "run": RUNS,
            "eval": e | ({"dtype": eval_dtype} if eval_dtype else {})} | top


def _experiment(model_dir, eval_dtype="bfloat16", **top):
    return parse_experiment(_raw(model_dir, eval_dtype, **top))


def test_an_experiment_in_bf16_states_the_float_models_shift_in_every_row(tiny_model_dir, tmp_path):
    df = runner.run_experiment(_experiment(tiny_model_dir), tmp_path / "bf16", progress=False).set_index("run")
    ref = runner.run_experiment(_experiment(tiny_model_dir, "float32"), tmp_path / "fp32",
                                progress=False).set_index("run")
    assert (df.eval_dtype == "bfloat16").all() and "eval_dtype" not in ref
    # the float model's float32 perplexity in every row is the float32 experiment's baseline, on the same windows
    assert df.eval_dtype_float_ppl_float32.tolist() == pytest.approx([ref.loc["fp32", "ppl"]] * 2, rel=1e-6)
    assert df.eval_dtype_float_ppl.nunique() == 1
    assert df.loc["fp32", "ppl"] == pytest.approx(df.loc["fp32", "eval_dtype_float_ppl"], rel=1e-4)
    for run in ("fp32", "rtn"):  # computed in bf16: close to, not equal to, the float32 numbers
        assert df.loc[run, "ppl"] != ref.loc[run, "ppl"]
        assert df.loc[run, "ppl"] == pytest.approx(ref.loc[run, "ppl"], rel=2e-2)
    assert df.loc["rtn", "kl_mean"] > 0
    md = (tmp_path / "bf16" / "tiny_bf16.md").read_text()
    a, b = df.loc["fp32", "eval_dtype_float_ppl_float32"], df.loc["fp32", "eval_dtype_float_ppl"]
    assert (f"the float model's perplexity is {b:.4f} in bfloat16 against {a:.4f} in float32 "
            f"({(b / a - 1) * 100:+.3f}%)") in md
    assert "computed in bfloat16" not in (tmp_path / "fp32" / "tiny_bf16.md").read_text()
    dev = torch.device("cpu")  # the default keeps every existing run key
    plain = _experiment(tiny_model_dir, None)
    fp32 = _experiment(tiny_model_dir, "float32")
    assert runner.run_key(plain, plain.runs[1], dev) == runner.run_key(fp32, fp32.runs[1], dev)
    bf16 = _experiment(tiny_model_dir)
    assert runner.run_key(bf16, bf16.runs[1], dev) != runner.run_key(fp32, fp32.runs[1], dev)


def test_bf16_evaluation_refuses_a_bf16_model_and_real_kernel_backends(tiny_model_dir):
    with pytest.raises(ValueError, match="this model loads as dtype = 'bfloat16': drop one"):
        _experiment(tiny_model_dir, "bfloat16", dtype="bfloat16")
    runs = [RUNS[0], {"name": "w8-torchao", "method": "rtn", "bits": 8, "backend": "torchao"}]
    with pytest.raises(ValueError, match="run 'w8-torchao' has backend = 'torchao'; eval.dtype = 'bfloat16' applies "
                                         "to PyTorch's simulated models only"):
        _experiment(tiny_model_dir, run=runs)
