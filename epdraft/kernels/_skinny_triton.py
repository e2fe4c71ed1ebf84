"""The Triton programs of `epdraft.kernels.skinny` (imported on first launch, never at package import).

A draft step's dense projections multiply few rows (N requests x B block rows, at most
`skinny.MAX_ROWS`) by large weights: memory-bound on the weight bytes. One program owns BLOCK_N weight rows (output columns)
over all of K and all of the step's rows, so the weight is read once, in full tiles, with no split-K
partials to reduce, and several weights (q, k, v) or a gate/up pair run in one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._step_triton import gated


@triton.jit
def _row_tiles(x_ptr, w_ptr, n0, M, N, K, stride_xm, stride_wn, acc,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + x[:M] @ w[n0 : n0 + BLOCK_N]^T over all of K (fp32 accumulation)."""
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + k) < K
        x = tl.load(x_ptrs + k0, mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=(n < N)[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def skinny_linear_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr,
    M, N0, N1, N2, K, stride_xm, stride_w0, stride_w1, stride_w2, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[:, concat] = x @ [w0; w1; w2]^T: programs [0, t0) own w0's tiles, then w1's, then w2's;
    a weight with N_i = 0 has no programs. out's columns are w0's, then w1's, then w2's."""
    pid = tl.program_id(0)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    which = (pid >= t0).to(tl.int32) + (pid >= t0 + t1).to(tl.int32)
    n0 = (pid - tl.where(which == 0, 0, tl.where(which == 1, t0, t0 + t1))) * BLOCK_N
    N = tl.where(which == 0, N0, tl.where(which == 1, N1, N2))
    col = tl.where(which == 0, 0, tl.where(which == 1, N0, N0 + N1))
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if which == 0:
        acc = _row_tiles(x_ptr, w0_ptr, n0, M, N, K, stride_xm, stride_w0, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    elif which == 1:
        acc = _row_tiles(x_ptr, w1_ptr, n0, M, N, K, stride_xm, stride_w1, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _row_tiles(x_ptr, w2_ptr, n0, M, N, K, stride_xm, stride_w2, acc, BLOCK_M, BLOCK_N, BLOCK_K)
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + m[:, None] * stride_om + (col + n)[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def skinny_gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, out_ptr,
    M, I, K, stride_xm, stride_wg, stride_wu, stride_om, limit, alpha,
    SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out = act(x @ wg^T, x @ wu^T) for one BLOCK_N column tile: the gate and up GEMMs and the
    gated activation (fp32, as `epdraft.layers.activations.gated_act`, rounded to out's dtype)
    in one program, the gate and up products rounded to x's dtype first as nn.Linear rounds them."""
    n0 = tl.program_id(0) * BLOCK_N
    dtype = out_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    wg_ptrs = wg_ptr + n[:, None].to(tl.int64) * stride_wg + k[None, :]
    wu_ptrs = wu_ptr + n[:, None].to(tl.int64) * stride_wu + k[None, :]
    g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):  # both weights' tiles in one loop: twice the loads in flight
        k_ok = (k0 + k) < K
        w_ok = (n < I)[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs + k0, mask=(m < M)[:, None] & k_ok[None, :], other=0.0)
        g = tl.dot(x, tl.trans(tl.load(wg_ptrs + k0, mask=w_ok, other=0.0)), g)
        u = tl.dot(x, tl.trans(tl.load(wu_ptrs + k0, mask=w_ok, other=0.0)), u)
    h = gated(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32), limit, alpha, SWIGLU, HAS_LIMIT)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], h.to(dtype), mask=(m < M)[:, None] & (n < I)[None, :])
