"""Where an ONNX Runtime session's time goes: its own per-node profile, summed per op type.

    ort_model = load_ort(directory, threads=1, profile=tmp / "ort")  # a session that writes a profile
    ...run it...
    path = ort_model.session.end_profiling()                         # the JSON (chrome-trace) file
    ops = op_times(path, skip_runs=1)                                # the first run (the prefill) left out

ORT writes one `model_run` event (cat "Session") per InferenceSession.run and, per node executed, a
`<node>_kernel_time` event (cat "Node") with the op type in args.op_name. A kernel event belongs to the run whose
[ts, ts + dur] holds its start. Times are microseconds as ORT measured them (its own clock, kernel time only: the
fences around a node and the copies of the feeds into the session are in model_run, not in any kernel).
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path


def load_events(path: str | Path) -> list[dict]:
    """The events of an ORT profile file (a JSON list, or {"traceEvents": [...]} in some versions)."""
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


LINEAR_OPS = ("MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def category(event: dict) -> str:
    """The part of a decoder step a kernel event belongs to, from its op type and the node name torch.onnx.export
    gave it: "linear" (the model's linears: MatMulNBits / MatMulInteger, and float MatMul / Gemm nodes named
    node_linear*), "attention" (the other MatMuls, Softmax), "concat" (float Concat: the KV cache's past + new, and
    rotary's halves), "other" (norms, rotary, masks, shape ops, elementwise)."""
    op, name = event.get("args", {}).get("op_name", "?"), event.get("name", "")
    if op in LINEAR_OPS or (op in ("MatMul", "Gemm", "FusedMatMul") and name.startswith("node_linear")):
        return "linear"
    if op in ("MatMul", "FusedMatMul", "Softmax"):
        return "attention"
    if op == "Concat" and any("float" in t for t in event.get("args", {}).get("input_type_shape", [{}])[0]):
        return "concat"
    return "other"


def op_times(path: str | Path, skip_runs: int = 0, key=None) -> dict:
    """{"runs": n, "run_us": total model_run µs, "kernel_us": total kernel µs, "ops": {op type: (µs, calls)}}
    over the runs after the first `skip_runs` (in time order). `key(event)`: what to sum by instead of the op type
    (e.g. `category`).

    Raises ValueError when the file holds no model_run event, or not more than skip_runs of them.
    """
    events = load_events(path)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    if len(runs) <= skip_runs:
        raise ValueError(f"{path}: {len(runs)} model_run event(s), none left after skipping {skip_runs}; was the "
                         "session created with enable_profiling and run before end_profiling()?")
    kept = runs[skip_runs:]
    starts = [r["ts"] for r in kept]
    ops: dict[str, list] = defaultdict(lambda: [0, 0])
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1  # the last kept run that started before this kernel
        if i < 0 or e["ts"] > kept[i]["ts"] + kept[i]["dur"]:
            continue
        op = key(e) if key is not None else e.get("args", {}).get("op_name", "?")
        ops[op][0] += e["dur"]
        ops[op][1] += 1
    kernel = sum(us for us, _ in ops.values())
    return {"runs": len(kept), "run_us": sum(r["dur"] for r in kept), "kernel_us": kernel,
            "ops": {op: (us, n) for op, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])}}
