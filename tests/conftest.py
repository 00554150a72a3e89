"""Shared fixtures. Eight host CPU devices so mesh tests run in one process (set before jax loads)."""

import os

from tests.train_helpers import FAST_COMPILE  # standard library only: nothing here has loaded jax yet

# LLVM's lowest optimisation level and the older fusion emitters for XLA's CPU code: less compiling for the suite
# (tests/train_helpers.py's FAST_COMPILE says what was measured; the learning runs compile as a user's run does)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per in-process vLLM engine
# torch's OpenMP threads sleep when they run out of work instead of spinning: the two test workers share two cores,
# and a spinning pool takes the core the other worker's run needs. Two embedded-default runs at once on the 2-core
# CI machine: the HF engine's generation took 1.1 s a step with PASSIVE against 5.0 s without, each step 9.9 s against
# 13.8 s; a run alone moved within the machine's noise either way (docs/benchmarks/ci_time_2026-12-06)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxppo.config import TrainerConfig  # noqa: E402
from tests.helpers import make_hf_checkpoint  # noqa: E402

# the test processes' own compiles go to JAX's persistent cache too, the one the runs they start use (the trainer's
# default, trainer.compilation_cache_dir): the many tests that compile the same programs in-process load them
# (tests/test_compare*.py: 183 s of CPU instead of 231 s, 2026-12-03). Here only, not inherited by subprocesses.
jax.config.update("jax_compilation_cache_dir", os.path.expanduser(TrainerConfig.compilation_cache_dir))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """A random-init Qwen2ForCausalLM (untied, q/k/v bias, GQA) saved with save_pretrained."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A random-init Qwen3ForCausalLM (q/k RMSNorm per head, no bias, head_dim apart from hidden / heads)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", num_attention_heads=4,
                              num_key_value_heads=2)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The embedded default's tiny BPE tokenizer (with chat template), saved as a HF tokenizer directory."""
    from jaxppo.data.synthetic import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _only_devices(monkeypatch, n: int) -> None:
    import jax

    first = jax.devices()[:n]
    monkeypatch.setattr(jax, "devices", lambda *a: first)
    monkeypatch.setattr(jax, "device_count", lambda *a: n)


@pytest.fixture
def one_device(monkeypatch):
    """In-process runs see one device, as a user's CPU run (and the subprocess runs of the tests) do; this test
    process has eight."""
    _only_devices(monkeypatch, 1)


@pytest.fixture
def two_devices(monkeypatch):
    """In-process runs see two of the test process's eight devices (a two-device data-parallel mesh)."""
    _only_devices(monkeypatch, 2)


# The files that take longest come first in collection order, the one that builds the embedded default's shared warm
# start (tests/train_helpers.py seed_warm_start) first: --dist loadfile hands whole files to the two xdist workers in
# this order (scripts/test.sh passes --no-loadscope-reorder: xdist otherwise sorts the files by their number of tests,
# which ran the learning files, few tests and long, last: a fresh-clone run at 99689ac had one worker idle for its
# last 290 s while the other ran them). The order is by each file's seconds in a fresh-clone run at fb1d9ad (tests
# 1723 s, 3334 test-seconds), except that test_lora.py, which waits for the warm start, follows a file that outlasts
# it; the files not named follow in their own order and fill in at the end.
FIRST = ("test_learning.py", "test_operability.py", "test_lora.py", "test_bench_scripts.py", "test_distributed.py",
         "test_trainer_options.py", "test_train.py", "test_memory_plan.py", "test_nothing_lost.py", "test_engine.py",
         "test_recipes.py", "test_ahead.py", "test_verl_oracle.py", "test_vllm_processes.py",
         "test_config_validation.py", "test_compare.py", "test_packing.py", "test_verl_cli.py",
         "test_compare_float64.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    if os.environ.get("JAXPPO_TEST_EXTENDED") != "1":
        skip = pytest.mark.skip(reason="an extended run: JAXPPO_TEST_EXTENDED=1 runs it")
        for item in items:
            if "extended" in item.keywords:
                item.add_marker(skip)
