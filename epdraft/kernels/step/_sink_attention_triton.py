"""The Triton program of `epdraft.kernels.step.sink_attention` (imported on first launch)."""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def sink_attention_kernel(
    q_ptr, ctx_ptr, valid_ptr, blk_ptr, sink_ptr, cos_ptr, sin_ptr, out_ptr,
    S, scale,
    stride_qn, stride_cn, stride_cs, stride_vn, stride_bn, stride_rn, stride_on,
    B: tl.constexpr, NUM_HEADS: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Request n, BLOCK_Q of its B * h query rows (row = b * h + head): softmax over [scale * q.k of
    the valid context rows and the B block rows, the head's sink], times the same rows as values;
    the trailing R channels rotated back at the row's position; rounded to out's dtype once."""
    enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < B * NUM_HEADS
    head, b = rows % NUM_HEADS, rows // NUM_HEADS
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    valid = (tl.load(valid_ptr + n * stride_vn + s, mask=s_ok, other=0) != 0) & s_ok
    j = tl.arange(0, BLOCK_B)
    j_ok = j < B
    q_rows = q_ptr + n * stride_qn + rows[:, None] * D
    ctx_rows = ctx_ptr + n * stride_cn + s[:, None] * stride_cs
    blk_rows = blk_ptr + n * stride_bn + j[:, None] * D
    sc = tl.zeros([BLOCK_Q, BLOCK_S], dtype=tl.float32)
    sb = tl.zeros([BLOCK_Q, BLOCK_B], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
        c = tl.load(ctx_rows + d[None, :], mask=s_ok[:, None], other=0.0)
        k = tl.load(blk_rows + d[None, :], mask=j_ok[:, None], other=0.0)
        sc += tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
        sb += tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    sc = tl.where(valid[None, :], sc * scale, float("-inf"))
    sb = tl.where(j_ok[None, :], sb * scale, float("-inf"))
    sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    m = tl.maximum(tl.maximum(tl.max(sc, axis=1), tl.max(sb, axis=1)), sink)
    pc = tl.exp(sc - m[:, None])
    pb = tl.exp(sb - m[:, None])
    den = tl.sum(pc, axis=1) + tl.sum(pb, axis=1) + tl.exp(sink - m)
    pc = (pc / den[:, None]).to(ctx_ptr.dtype.element_ty)
    pb = (pb / den[:, None]).to(blk_ptr.dtype.element_ty)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        c = tl.load(ctx_rows + d[None, :], mask=s_ok[:, None], other=0.0)
        k = tl.load(blk_rows + d[None, :], mask=j_ok[:, None], other=0.0)
        o = tl.dot(pc, c, input_precision=DOT_PRECISION) + tl.dot(pb, k, input_precision=DOT_PRECISION)
        if d0 >= D - R:  # K = V carries the keys' rotation: undo it at the query's position
            pair = (d0 - (D - R)) // 2 + tl.arange(0, BLOCK_D // 2)
            at = n * stride_rn + b[:, None] * (R // 2) + pair[None, :]
            cos = tl.load(cos_ptr + at, mask=row_ok[:, None], other=1.0)
            sin = tl.load(sin_ptr + at, mask=row_ok[:, None], other=0.0)
            even, odd = tl.split(tl.reshape(o, (BLOCK_Q, BLOCK_D // 2, 2)))
            o = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), (BLOCK_Q, BLOCK_D))
        tl.store(out_ptr + n * stride_on + rows[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip
