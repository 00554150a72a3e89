"""scripts/trace_summary.py on a hand-built trace: categories, overlap-aware busy time, stream filtering."""

import gzip
import json

from scripts.trace_summary import category, find_traces, summarise, union_length


def meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def op(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_categories():
    assert category("all-reduce-start.3") == "collective" and category("ncclDevKernel_AllGather") == "collective"
    assert category("cudnn$fmha_fwd") == "attention"
    assert category("sm90_xmma_gemm_bf16") == "matmul" and category("dot.12") == "matmul"
    assert category("loop_multiply_fusion") == "other" and category("memcpy32_post") == "copy"


def test_union_length_counts_overlap_once():
    assert union_length([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25


def test_summary_per_device_streams_only(tmp_path):
    events = [meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), meta(3, "/device:GPU:1"),
              meta(2, "Stream #14(Compute)", 10), meta(2, "Stream #20(NCCL)", 11), meta(2, "XLA Modules", 12),
              meta(3, "Stream #14(Compute)", 10),
              op(1, 0, "PjitFunction", 0, 1000),  # host: ignored
              op(2, 12, "jit_update", 0, 1000),  # a module span: not a kernel
              op(2, 10, "sm90_xmma_gemm", 0, 400), op(2, 10, "loop_add_fusion", 500, 100),
              op(2, 11, "all-reduce-start", 300, 300),  # overlaps the gemm by 100
              op(3, 10, "cudnn_fmha", 0, 200), op(3, 10, "cudnn_fmha", 800, 200)]
    s = summarise(events)
    assert set(s) == {"/device:GPU:0", "/device:GPU:1"}
    g0 = s["/device:GPU:0"]
    assert g0["window_ms"] == 0.6 and abs(g0["busy_ms"] - 0.6) < 1e-9 and abs(g0["idle_frac"]) < 1e-9
    assert g0["categories_ms"] == {"matmul": 0.4, "collective": 0.3, "other": 0.1}
    g1 = s["/device:GPU:1"]
    assert g1["busy_ms"] == 0.4 and abs(g1["idle_frac"] - 0.6) < 1e-9
    assert g1["top_ops"] == [{"name": "cudnn_fmha", "ms": 0.4, "count": 2}]
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert find_traces(tmp_path) == [path]
