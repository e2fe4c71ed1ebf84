"""The Triton programs of `epdraft.kernels.step.hc` (imported on first launch, never at package import).

Each equals a torch function of `epdraft.models.hyper_connections` to fp32 rounding order: the math
runs in fp32 and rounds to the streams' dtype where that code does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def hc_project_kernel(
    x_ptr, fn_ptr, part_ptr,
    R, X, M, stride_x, stride_fn, SPLIT_COLS,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (row block, split s) over columns [s * SPLIT_COLS, (s + 1) * SPLIT_COLS) of x [R, X]:
    part[s, r, :M] = x[r] . fn[:, cols] and part[s, r, M] = sum x[r]^2, fp32 (`hc_mixes_kernel` sums
    the splits in order)."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)
    row_ok, m_ok = rows < R, ms < M
    acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, SPLIT_COLS, BLOCK_K):
        cols = split * SPLIT_COLS + k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < X
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(fn_ptr + ms[:, None] * stride_fn + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    out = part_ptr + (split * R + rows[:, None]).to(tl.int64) * (M + 1) + ms[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & m_ok[None, :])
    tl.store(part_ptr + (split * R + rows).to(tl.int64) * (M + 1) + M, sq, mask=row_ok)


@triton.jit
def hc_mixes_kernel(
    part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
    R, S, X, ITERS, norm_eps, hc_eps,
    C: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """BLOCK_R rows: the S partials summed in order, times rsqrt(mean square + norm_eps), then
    `split_mixes`: pre = sigmoid + hc_eps, post = 2 sigmoid, comb by `sinkhorn` (ITERS)."""
    enter(PDL)
    M: tl.constexpr = (2 + C) * C
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    c = tl.arange(0, C)
    cc = tl.arange(0, C * C)
    pre = tl.zeros([BLOCK_R, C], dtype=tl.float32)
    post = tl.zeros([BLOCK_R, C], dtype=tl.float32)
    comb = tl.zeros([BLOCK_R, C * C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(S):
        row_ptr = part_ptr + (s * R + rows).to(tl.int64) * (M + 1)
        pre += tl.load(row_ptr[:, None] + c[None, :], mask=ok[:, None], other=0.0)
        post += tl.load(row_ptr[:, None] + C + c[None, :], mask=ok[:, None], other=0.0)
        comb += tl.load(row_ptr[:, None] + 2 * C + cc[None, :], mask=ok[:, None], other=0.0)
        sq += tl.load(row_ptr + M, mask=ok, other=0.0)
    rs = (1.0 / tl.sqrt(sq / X + norm_eps))[:, None]
    pre = tl.sigmoid(pre * rs * tl.load(scale_ptr) + tl.load(base_ptr + c)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(post * rs * tl.load(scale_ptr + 1) + tl.load(base_ptr + C + c)[None, :])
    logits = tl.reshape(comb * rs * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * C + cc)[None, :], (BLOCK_R, C, C))
    e = tl.exp(logits - tl.max(logits, axis=2, keep_dims=True))
    m = e / tl.sum(e, axis=2, keep_dims=True) + hc_eps
    m = m / (tl.sum(m, axis=1, keep_dims=True) + hc_eps)
    for _ in range(ITERS - 1):
        m = m / (tl.sum(m, axis=2, keep_dims=True) + hc_eps)
        m = m / (tl.sum(m, axis=1, keep_dims=True) + hc_eps)
    tl.store(pre_ptr + rows[:, None] * C + c[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + rows[:, None] * C + c[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + rows[:, None] * (C * C) + cc[None, :], tl.reshape(m, (BLOCK_R, C * C)), mask=ok[:, None])


@triton.jit
def _stream_tile(x_ptr, H, stride_x, C: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's row r and H block of the streams [R, C, H]: (r, h, c, h < H, the C x BLOCK_H
    tile in fp32)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, C)
    ok = h < H
    x = tl.load(x_ptr + r * stride_x + c[:, None] * H + h[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    return r, h, c, ok, x


@triton.jit
def hc_collapse_kernel(
    x_ptr, pre_ptr, out_ptr,
    H, stride_x, stride_o,
    C: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Row r, one H block: out[r] = sum_j pre[r, j] x[r, j] in fp32, rounded to out's dtype (`collapse`)."""
    enter(PDL)
    r, h, c, ok, x = _stream_tile(x_ptr, H, stride_x, C, BLOCK_H)
    pre = tl.load(pre_ptr + r * C + c)
    tl.store(out_ptr + r * stride_o + h, tl.sum(pre[:, None] * x, axis=0).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def hc_write_back_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    H, stride_y, stride_x,
    C: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Row r, one H block: out[r, k] = post[r, k] y[r] + sum_j comb[r, j, k] x[r, j] in fp32, rounded to
    x's dtype (`write_back`); out is [R, C, H] contiguous."""
    enter(PDL)
    r, h, c, ok, x = _stream_tile(x_ptr, H, stride_x, C, BLOCK_H)
    y = tl.load(y_ptr + r * stride_y + h, mask=ok, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + r * C * C + c[:, None] * C + c[None, :])  # [j, k]
    post = tl.load(post_ptr + r * C + c)
    new = post[:, None] * y[None, :] + tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [k, H block]
    tl.store(out_ptr + r * C * H + c[:, None] * H + h[None, :], new.to(out_ptr.dtype.element_ty), mask=ok[None, :])
