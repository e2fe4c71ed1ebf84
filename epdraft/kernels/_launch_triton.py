"""Device side of `epdraft.kernels.launch`: the PDL entry of a kernel and the weights' L2 prefetch
(imported by the kernel modules, never at package import).

A kernel taking `PDL: tl.constexpr` calls `enter(PDL)` before anything else, or `launch_next(PDL)`,
reads of never-written memory only (`prefetch_l2`), then `wait_previous(PDL)`. With PDL off these
compile to nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel's programs start now (they wait in `wait_previous` for this one to finish)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first call: launch the next kernel early, then wait for the previous one."""
    launch_next(PDL)
    wait_previous(PDL)


@triton.jit
def prefetch_l2(row_ptrs, nbytes):
    """Fetch `nbytes` (a multiple of 16) from each 16-byte-aligned pointer of `row_ptrs` into L2,
    one bulk-copy-engine instruction per pointer (sm_90 `cp.async.bulk.prefetch.L2`); the result
    is a dummy."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r", [row_ptrs, nbytes],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
