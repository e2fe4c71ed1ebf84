"""The Triton program of `epdraft.kernels.step.kv_finish` (imported on first launch)."""

from __future__ import annotations

import triton
import triton.language as tl

from epdraft.kernels._launch_triton import enter


@triton.jit
def kv_finish_kernel(
    kv_ptr, cos_ptr, sin_ptr, slots_ptr, pos_ptr, out_ptr,
    stride_kv, stride_rope, stride_op, stride_ow, window,
    D: tl.constexpr, R: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr, HALF_P: tl.constexpr,
    FAKE_QUANT: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One K=V row: its D - R leading channels through the FP8 e4m3 round trip (FAKE_QUANT, a
    power-of-two scale per GROUP channels) or as they are, its trailing R channels rotated as
    pairs at the row's angle (fp32, rounded to the row's dtype once). Written to out row `row`,
    or (RING) to ring row (slot, position % window) of the row's slot and position, in out's dtype
    after the row's dtype (the torch chain's two casts)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if RING:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        dst = out_ptr + slot * stride_op + (pos % window) * stride_ow
    else:
        dst = out_ptr + row * stride_op
    src = kv_ptr + row * stride_kv
    dtype = kv_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    if D > R:
        g = tl.arange(0, GROUPS_P)[:, None]
        c = tl.arange(0, GROUP_P)[None, :]
        ok = (g < NUM_GROUPS) & (c < GROUP)
        offs = g * GROUP + c
        x = tl.load(src + offs, mask=ok, other=0.0)
        if FAKE_QUANT:
            xf = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4)  # normal: its bits are M * 2^E, M in [1, 2)
            # scale 2^e, e = ceil(log2(amax / 448)) in exact arithmetic: the least e with amax <= 1.75 * 2^(e + 8),
            # i.e. E - 8, plus one when M > 1.75 (mantissa field above 0x600000). No division, no log2.
            bits = amax.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            scale = ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None]  # e in [-22, 120]: both normal
            inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
            # |x| * 2^-e <= 448 by e's choice, so the clamp of the torch chain never bites; the products by
            # powers of two are exact, the cast rounds to nearest even (cvt.rn.satfinite.e4m3x2.f32)
            q = (xf * inv_scale).to(tl.float8e4nv).to(tl.float32) * scale
            # a NaN or inf in a group makes the torch chain's scale NaN or inf: the whole group NaN
            finite = tl.max(tl.where(tl.abs(xf) < float("inf"), 0, 1), axis=1) == 0
            x = tl.where(finite[:, None], q, float("nan")).to(dtype)
        tl.store(dst + offs, x.to(out_dtype), mask=ok)
    i = tl.arange(0, HALF_P)
    i_ok = i < R // 2
    pair = (D - R) + 2 * i[:, None] + tl.arange(0, 2)[None, :]  # [HALF_P, 2]: channels (even, odd) of pair i
    even, odd = tl.split(tl.load(src + pair, mask=i_ok[:, None], other=0.0).to(tl.float32))
    cos = tl.load(cos_ptr + row * stride_rope + i, mask=i_ok, other=1.0)
    sin = tl.load(sin_ptr + row * stride_rope + i, mask=i_ok, other=0.0)
    rotated = tl.join(even * cos - odd * sin, odd * cos + even * sin)
    tl.store(dst + pair, rotated.to(dtype).to(out_dtype), mask=i_ok[:, None])
