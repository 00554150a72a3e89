"""Whether CUDA MPS's client priority (`CUDA_MPS_CLIENT_PRIORITY`, 0 normal / 1 below normal) lets a decode-like
process's small kernels go first beside a training-like process's large ones (torch only; no vLLM, no JAX).

A "trainer" process multiplies 8192 x 8192 bf16 matrices back to back for a fixed time; a "decoder" process, started
once the trainer is busy, runs steps of 48 small matmuls (256 x 896 by 896 x 4864, a 0.5B model's MLP shape), each
step synchronised, and records its steps' milliseconds. Phases, each a fresh pair of processes: alone (decoder
only), time-sliced (both, no MPS), MPS (both clients of one daemon, equal priority), MPS with the trainer at
below-normal priority, and the decoder's work on a stream of the highest priority (time-sliced and under MPS).
Prints one JSON line per phase (decoder step ms median / p90, trainer TFLOP/s) and writes them to --out.
Usage (on the GPU machine, torch's interpreter):
    python docs/benchmarks/device/2026-12-08_mps_priority_probe.py --out $OUT/mps_priority.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROLE = """
import json, sys, time, torch
role, seconds = sys.argv[1], float(sys.argv[2])
torch.cuda.init()
dev = torch.device("cuda")
if role == "trainer":
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    print("ready", flush=True)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        n += 8
    dt = time.perf_counter() - t0
    print(json.dumps({"trainer_tflops": 2 * 8192 ** 3 * n / dt / 1e12}), flush=True)
else:
    if role == "decoder_high":  # its work on a stream of the highest priority instead of the default stream
        torch.cuda.set_stream(torch.cuda.Stream(priority=-100))  # out of range: clamped to the highest
    x = torch.randn(256, 896, device=dev, dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device=dev, dtype=torch.bfloat16)
    for _ in range(20):
        x @ w
    torch.cuda.synchronize()
    ms, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s = time.perf_counter()
        for _ in range(48):
            x @ w
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - s) * 1e3)
    ms.sort()
    print(json.dumps({"decoder_steps": len(ms), "decoder_ms_median": ms[len(ms) // 2],
                      "decoder_ms_p90": ms[int(len(ms) * 0.9)]}), flush=True)
"""


def _start(role: str, seconds: float, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ROLE, role, str(seconds)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _last_json(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    rows = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        return {"error": out[-2000:]}
    return json.loads(rows[-1])


def phase(name: str, env: dict, trainer_env: dict | None, seconds: float, decoder: str = "decoder") -> dict:
    trainer = None
    if trainer_env is not None:
        trainer = _start("trainer", seconds + 4.0, trainer_env)
        assert trainer.stdout.readline().strip() == "ready", "the trainer process did not start"
    proc = _start(decoder, seconds, env)
    row = {"phase": name, **_last_json(proc)}
    if trainer is not None:
        row.update(_last_json(trainer))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    base = dict(os.environ)
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_CLIENT_PRIORITY"):
        base.pop(k, None)
    rows = [phase("alone", base, None, args.seconds), phase("time_sliced", base, base, args.seconds),
            phase("time_sliced_decoder_high_stream", base, base, args.seconds, decoder="decoder_high")]
    where = tempfile.mkdtemp(prefix="mps-prio-")
    mps = dict(base, CUDA_MPS_PIPE_DIRECTORY=where, CUDA_MPS_LOG_DIRECTORY=where)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=mps, check=True)
    try:
        rows.append(phase("mps", mps, mps, args.seconds))
        rows.append(phase("mps_trainer_below_normal", dict(mps, CUDA_MPS_CLIENT_PRIORITY="0"),
                          dict(mps, CUDA_MPS_CLIENT_PRIORITY="1"), args.seconds))
        rows.append(phase("mps_decoder_high_stream", mps, mps, args.seconds, decoder="decoder_high"))
        rows.append(phase("mps_alone", mps, None, args.seconds))
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=mps, text=True, timeout=60)
        control_log = os.path.join(where, "control.log")
        if os.path.exists(control_log):
            rows.append({"phase": "control_log", "text": open(control_log).read()[-3000:]})
        shutil.rmtree(where, ignore_errors=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
