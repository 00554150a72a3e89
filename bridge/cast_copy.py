"""One kernel launch per parameter: fp32 layers -> their bf16 destinations, cast in the copy.

`torch._foreach_copy_` with a dtype change runs one cast-copy kernel per layer at ~80% of the device's
copy bandwidth (measured on the H200, docs/benchmarks.md, issue 5). This Triton kernel reads a whole
stacked parameter ([layers, ...] fp32, contiguous: the train state's buffer through DLPack) and
writes each layer to its own destination (a row range of one of the engine's fused parameters),
found in a table of destination addresses, in one launch with wide loads and stores.

The cast is round-to-nearest-even done on the bits (the same result as torch's and XLA's conversion
for every value; NaN stays NaN), so the kernel is exact under Triton's CPU interpreter too, which
is how the tests check it.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `usable` says no, callers use torch's copy
    triton = None

BLOCK = 4096


def usable(src: torch.Tensor, dsts: list[torch.Tensor]) -> bool:
    """Whether `cast_copy(src, dsts)` applies: fp32 contiguous source [len(dsts), ...] on a GPU (or
    on the CPU under TRITON_INTERPRET=1, for tests), contiguous bf16 destinations of one layer each."""
    return _destinations_fit(dsts) and _source_fits(src, dsts)


def _destinations_fit(dsts: list[torch.Tensor]) -> bool:
    if triton is None or not dsts or not (dsts[0].is_cuda or _interpreting()):
        return False
    n, device = dsts[0].numel(), dsts[0].device
    return all(d.dtype == torch.bfloat16 and d.is_contiguous() and d.numel() == n and d.device == device for d in dsts)


def _source_fits(src: torch.Tensor, dsts: list[torch.Tensor]) -> bool:
    return (src.dtype == torch.float32 and src.is_contiguous() and src.device == dsts[0].device
            and src.numel() == len(dsts) * dsts[0].numel())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class PointerTable:
    """One parameter's destinations as a device table of addresses, for `cast_copy`. The destinations
    are checked and the table built only when an address changes (the engine reallocated its
    parameters): a steady-state push checks the source alone and copies nothing to the device."""

    def __init__(self):
        self._ptrs: tuple[int, ...] = ()
        self._table: torch.Tensor | None = None

    def get(self, src: torch.Tensor, dsts: list[torch.Tensor]) -> torch.Tensor | None:
        """The address table, or None where the kernel does not apply (`usable`)."""
        ptrs = tuple(d.data_ptr() for d in dsts)
        if ptrs != self._ptrs:
            fit = _destinations_fit(dsts)
            self._table = torch.tensor(ptrs, dtype=torch.int64, device=dsts[0].device) if fit else None
            self._ptrs = ptrs
        return self._table if self._table is not None and _source_fits(src, dsts) else None


def cast_copy(src: torch.Tensor, dsts: list[torch.Tensor], table: torch.Tensor) -> None:
    """dsts[i] <- bf16(src[i]) for every layer i, one launch on the current stream (asynchronous)."""
    n = src.numel() // len(dsts)
    _cast_copy_kernel[(triton.cdiv(n, BLOCK), len(dsts))](src, table, n, BLOCK=BLOCK, num_warps=8)


if triton is not None:

    @triton.jit
    def _cast_copy_kernel(src, dst_ptrs, n, BLOCK: tl.constexpr):
        layer = tl.program_id(1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(src + layer.to(tl.int64) * n + offs, mask=keep)
        bits = x.to(tl.uint32, bitcast=True)
        # round to nearest, ties to even: add 0x7fff plus the lowest bit that stays, keep the high half
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN: a quiet NaN (rounding could carry it to inf)
        dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.uint16))
        tl.store(dst + offs, rounded.to(tl.uint16), mask=keep)
