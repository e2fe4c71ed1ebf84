"""The Triton program of `block_attention` (imported on first launch, never at package import).

One program per (request, KV head, key split), reading the request's pool slot `slots[n]`: the
block's query rows of every query head that shares the KV head (G heads x B rows, one MMA tile)
against the split's key tiles, online softmax in fp32; it writes the split's unnormalized output
with its row max and row sum, which the caller merges, or, where the keys take one split (FINISH),
the normalized output itself. Keys past the request's length are never read, so the cost follows
each request's own context, not the pool's capacity, and the grid (hence a CUDA graph of it) does
not depend on the lengths.
"""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def block_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, acc_ptr, stat_ptr, out_ptr,
    stride_qn, stride_qh, stride_qb,
    stride_kn, stride_kh, stride_ks,
    stride_vn, stride_vh, stride_vs,
    stride_an, stride_ah, stride_as, stride_ar,
    stride_sn, stride_sh, stride_ss,
    stride_on, stride_ob, stride_oh,
    scale_log2,
    chunk,
    G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    FINISH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    enter(PDL)
    n = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)  # j x (S x D) passes 2^31 in a long-context pool slot
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    length = tl.load(lens_ptr + n)
    start = split * chunk
    stop = tl.minimum(start + chunk, length)

    rows = tl.arange(0, ROWS)
    row_ok = rows < G * B
    head = j * G + rows // B
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + n * stride_qn + head[:, None] * stride_qh + (rows % B)[:, None] * stride_qb + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((ROWS,), -1.0e30, tl.float32)  # finite: an empty split or tile never makes inf - inf
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    k_base = k_ptr + slot * stride_kn + j * stride_kh
    v_base = v_ptr + slot * stride_vn + j * stride_vh
    num_tiles = tl.cdiv(stop - start, BLOCK_S)
    for t in range(0, num_tiles):
        s = start + t * BLOCK_S + tl.arange(0, BLOCK_S)
        s_ok = s < stop
        k = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if FINISH:  # the one split: l_i >= 1 (the row's max key contributes 2^0), as the merge divides
        o_ptrs = out_ptr + n * stride_on + (rows % B)[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        a_ptrs = acc_ptr + n * stride_an + j * stride_ah + split * stride_as + rows[:, None] * stride_ar + d[None, :]
        tl.store(a_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])
        s_base = stat_ptr + n * stride_sn + j * stride_sh + split * stride_ss
        tl.store(s_base + rows * 2, m_i, mask=row_ok)
        tl.store(s_base + rows * 2 + 1, l_i, mask=row_ok)
