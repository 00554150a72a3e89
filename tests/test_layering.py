"""The arrow points one way: jaxppo's core modules never import torch or the bridge."""

import subprocess
import sys

CORE = ["jaxppo", "jaxppo.models", "jaxppo.ppo", "jaxppo.sharding", "jaxppo.data", "jaxppo.data.synthetic",
        "jaxppo.rewards", "jaxppo.rewards.model", "jaxppo.compare"]


def test_core_imports_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE)
            + "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'bridge', 'vllm'))]\n"
              "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_every_test_runs_under_a_time_limit(pytestconfig):
    """pytest-timeout is active with the project's limit: a test of a hang fails instead of hanging CI."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 0 < float(pytestconfig.getini("timeout")) <= 1800
