"""The Triton cast-copy of the direct weight push (bridge/cast_copy.py), run by Triton's CPU interpreter
in a child process (the interpreter is chosen when the kernel is defined): bit-equal to torch's bf16
cast for any fp32 bits, each layer into its own destination, and the whole DirectCopy push through it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cast_copy_kernel_under_the_interpreter(tiny_qwen):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "tests.bridge.cast_copy_case", str(tiny_qwen)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
