"""Run under TRITON_INTERPRET=1 (Triton's CPU interpreter) by tests/bridge/test_cast_copy.py:
`python -m tests.bridge.cast_copy_case <tiny checkpoint dir>`; prints OK or fails."""

import sys

import numpy as np
import torch

from bridge import cast_copy


def check_kernel() -> None:
    rng = np.random.default_rng(0)
    layers, n = 3, 10_000
    bits = rng.integers(-2**31, 2**31 - 1, (layers, n), dtype=np.int64).astype(np.int32)  # any value at all
    bits[1, :1000] = (rng.integers(0, 2**16, 1000, dtype=np.int64).astype(np.int32) << 16) | 0x8000  # exact ties
    src = torch.from_numpy(bits).view(torch.float32)
    src[2, :6] = torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45, -0.0])
    pool = torch.full((layers, 2 * n), 7.0, dtype=torch.bfloat16)  # each layer lands inside a bigger tensor
    dsts = [pool[i, 11:11 + n] for i in range(layers)]
    assert cast_copy.usable(src, dsts)
    table = cast_copy.PointerTable()
    cast_copy.cast_copy(src, dsts, table.get(src, dsts))
    want = src.to(torch.bfloat16)
    for i, d in enumerate(dsts):
        nan = torch.isnan(want[i])
        assert torch.equal(torch.isnan(d), nan), i
        assert torch.equal(d.view(torch.int16)[~nan], want[i].view(torch.int16)[~nan]), i  # bit for bit
    assert (pool[:, :11] == 7).all() and (pool[:, 11 + n:] == 7).all()  # nothing written outside
    assert not cast_copy.usable(src.to(torch.float16), dsts) and not cast_copy.usable(src[:, ::2], dsts)
    assert table.get(src.to(torch.float16), dsts) is None  # the source is checked at every push
    assert cast_copy.PointerTable().get(src, [d.float() for d in dsts]) is None


def check_push(ckpt: str) -> None:
    from bridge.push import DirectCopy
    from jaxppo.models import load_model
    from jaxppo.models.hf_io import HFWeights
    from tests.bridge.test_push import check

    _, params, _ = load_model(ckpt)
    launches = []
    real = cast_copy.cast_copy
    cast_copy.cast_copy = lambda src, dsts, table: (launches.append(len(dsts)), real(src, dsts, table))
    check(params, params)  # the whole push through the kernel, against vLLM's layout built by concatenation
    n_params = len(HFWeights(params).shapes())
    assert launches and sum(launches) == n_params, (launches, n_params)  # every tensor, one launch per parameter
    assert DirectCopy  # imported: the plan under test


if __name__ == "__main__":
    check_kernel()
    check_push(sys.argv[1])
    print("OK")
