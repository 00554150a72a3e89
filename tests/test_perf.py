"""FLOPs as computed and the peak they are measured against (jaxppo/perf.py), by hand."""

import numpy as np
import pytest

from jaxppo.models import ModelConfig
from jaxppo.perf import SPEC_PEAK_FLOPS, device_peak_flops, flops_model, step_flops


def test_flops_count_causal_attention_and_the_head_on_response_tokens_only():
    cfg = ModelConfig(family="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1e4, tie_word_embeddings=True, attention_bias=True, max_position_embeddings=128)
    m = flops_model(cfg)
    # per layer: q 64x64, k and v 64x32 each, o 64x64, gate / up / down 64x128 each = 4096+2048+2048+4096+24576
    assert m.per_token == 6 * 2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 128)
    assert m.attention == 6 * 2 * 64  # 6 x layers x (heads x head_dim): the lower triangle only
    assert m.head == 6 * 64 * 1000
    seq, resp = np.array([10, 30]), np.array([4, 20])
    want = m.per_token * 40 + m.attention * (100 + 900) + m.head * 24
    assert step_flops(m, seq, resp) == pytest.approx(want)
    assert step_flops(flops_model(cfg, lm_head=False), seq) == pytest.approx(want - m.head * 24)

    # LoRA rank 4 on q and down only: the frozen base does forward + input gradients (4x), the adapters 6x
    from jaxppo.models.lora import LoraSpec

    lora = flops_model(cfg, lora=LoraSpec(4, 8.0, ("q_proj", "down_proj")))
    adapters = 2 * (4 * (64 + 64) + 4 * (128 + 64))  # per layer r (in + out) per target, 2 layers
    assert lora.per_token == 4 * 2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 128) + 6 * adapters
    assert lora.head == 4 * 64 * 1000 and lora.attention == m.attention


def test_mfu_is_measured_against_the_card_specification():
    assert SPEC_PEAK_FLOPS["NVIDIA H200"] == 989e12

    class H200:
        device_kind = "NVIDIA H200"
        platform = "gpu"

    assert device_peak_flops(H200()) == (989e12, "spec (NVIDIA H200)")
    peak, source = device_peak_flops()  # this machine's CPU: not in the table, so measured
    assert peak > 0 and source.startswith("measured")


def test_timer_separates_a_phase_that_computes_from_one_that_waits():
    """The generation phase's CPU time tells a slow generation that did more work from one that waited: a phase
    that computes accrues the CPU time it used, one blocked on an event almost none of its wall time. (The busy
    phase is bounded by CPU time, not wall time: on a loaded two-core CI machine a 0.3 s wall-clock spin got 0.15 s
    of CPU, 2026-12-03.)"""
    import threading
    import time

    from jaxppo.step import Timer

    timer = Timer(cpu_phases=("busy", "idle"))
    with timer("busy"):  # spins until this thread has had 0.3 s of CPU, however busy the machine is (the process's
        # CPU time counts its other threads too, and reached 0.3 s in 0.295 s of wall time in a CI run)
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.3:
            pass
    done = threading.Event()
    with timer("idle"):
        threading.Timer(0.3, done.set).start()  # started inside the phase: it lasts at least the timer's 0.3 s
        assert done.wait(10)
    with timer("other"):  # not asked: wall time only
        pass
    t = timer.times
    assert t["perf/cpu_s/busy"] >= 0.3 and t["timing_s/busy"] >= 0.3
    assert t["timing_s/idle"] >= 0.3 and t["perf/cpu_s/idle"] < 0.2 * t["timing_s/idle"]
    assert t["perf/ctx_switches/busy"] >= 0 and "perf/cpu_s/other" not in t
    assert set(t) >= {"timing_s/busy", "timing_s/idle", "timing_s/other"}
