"""scripts/trace_summary.py on a hand-built trace: categories, overlap-aware busy time, stream filtering."""

import gzip
import json

from scripts.trace_summary import category, find_traces, summarise, summarise_latest, union_length


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
    assert summarise_latest(tmp_path) == s and summarise_latest(tmp_path / "plugins" / "none") is None


def test_a_torch_trace_tells_streams_at_once_and_each_regions_gpu_share(tmp_path):
    """A torch profiler trace (the trainer's trainer.profile_tools=[torch]): per stream busy time, the time two or
    more streams ran kernels at once, each named region's GPU busy share, the CUDA runtime calls by name."""
    from scripts.trace_summary import main, summarise_torch

    def kernel(stream, name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"device": 0, "stream": stream}}

    events = [
        kernel(7, "loop_add_fusion", 0, 100), kernel(7, "sm90_xmma_gemm_bf16", 150, 100),  # XLA's stream
        kernel(13, "flash_fwd_kernel", 50, 100), kernel(13, "topk_log_softmax_kernel", 150, 50),  # the engine's
        {"ph": "X", "cat": "user_annotation", "name": "gen", "pid": 1, "tid": 2, "ts": 0, "dur": 400},
        {"ph": "X", "cat": "user_annotation", "name": "update_actor", "pid": 1, "tid": 1, "ts": 1000, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 2, "ts": 10, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 2, "ts": 60, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 2, "ts": 5, "dur": 3},
    ]
    s = summarise_torch(events)
    assert s["gpu_busy_ms"] == 0.25 and s["window_ms"] == 0.25  # 0..250 us, every instant busy on some stream
    assert s["streams_at_once_ms"] == 0.1  # 50..100 and 150..200
    x, v = s["streams"]["device 0 stream 7"], s["streams"]["device 0 stream 13"]
    assert (x["busy_ms"], x["kernels"], v["busy_ms"], v["kernels"]) == (0.2, 2, 0.15, 2)
    assert v["categories_ms"] == {"attention": 0.1, "sampling": 0.05}
    assert s["regions"]["gen"] == {"count": 1, "wall_ms": 0.4, "gpu_busy_ms": 0.25, "gpu_busy_frac": 0.625}
    assert s["regions"]["update_actor"]["gpu_busy_ms"] == 0.0
    assert s["cuda_runtime_ms"] == {"cudaGraphLaunch": {"ms": 0.05, "count": 2}}
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / "torch_trace.json").write_text(json.dumps({"traceEvents": events}))
    assert main([str(tmp_path), "--json-out", str(tmp_path / "s.json")]) == 0  # found and read as torch's
    assert json.loads((tmp_path / "s.json").read_text()).popitem()[1]["streams_at_once_ms"] == 0.1
