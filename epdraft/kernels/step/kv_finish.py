"""The finish of a DeepSeek DSpark draft's K=V row as one Triton launch (CUDA): the FP8 fake quant of
its non-rope channels and the interleaved rotary of its rope channels, into a new tensor (a step's
block rows) or straight into a `WindowKVPool` ring (a commit's context rows).

Why: the torch chain (`DeepseekDSparkAttention._kv` after `kv_norm`: `fp8_ue8m0_roundtrip`'s fp32
copy, abs/amax/clamp/log2/ceil/exp2, divide, clamp, the two FP8 casts, multiply, the cast back and
the cat, then `apply_interleaved_rope`'s slices, products, stack, cast and cat, then the pool's
index-put) is ~25 small kernels a layer. They ran in every draft step for the block's rows and in
every commit for the context rows: on a V4.1-Flash draft's commit 126 kernels, 0.5-0.7 ms for
~0.25 ms of kernel time. Here it is one launch a layer, one program per row.

What it equals, row by row (kv in the model's dtype, after `kv_norm`):
- channels [0, D - R) with `fake_quant`: `fp8_ue8m0_roundtrip` (groups of 64 channels, or all of them
  when D - R is not a multiple of 64): the group's amax of the fp32 values floored at 1e-4, scale
  2^ceil(log2(amax / 448)), x / scale cast to FP8 e4m3 (round to nearest even) and back, times the
  scale, rounded to the model's dtype. Bit for bit, except for the scale's exponent, which is taken
  exactly (the least e with amax <= 448 * 2^e, from amax's fp32 bits: no division, no log2) where
  the torch chain rounds twice in fp32 (amax / 448, then log2; on CUDA the division is a product by
  fp32(1 / 448)). The exponents differ only when amax lies one to a few fp32 ulps above 448 * 2^k:
  the chain can then take 2^k (and clamp the largest value to 448) where the exact scale is
  2^(k+1). Even then e4m3's own exponent makes both scales give the same values (the largest comes
  out 448 * 2^k either way) except for the group's values under 2^-6 of the scale, which land on
  FP8 subnormals and round on grids a factor 2 apart. Such an amax needs 22 or more significant
  bits, so bf16 and fp16 rows never meet it; amax = 448 * 2^k itself gives 2^k on both (fp32(448 *
  fp32(1 / 448)) is 1). A group holding a NaN or inf comes out all NaN, as the torch chain's does.
  Without `fake_quant` (or R = D) the channels pass through;
- channels [D - R, D): `apply_interleaved_rope` at the row's cos / sin: pairs (2i, 2i + 1) rotated in
  fp32, rounded to the model's dtype once (the products and the sum may fuse into an FMA: an fp32
  rounding apart).
Then, in the ring form, cast to the ring's dtype and written to ring[slot, position % W], as
`WindowKVPool.store` does (rows that `placement` sent to the pad slot land there like any other).
The grid depends on shapes only and nothing is read on the host: a CUDA graph can hold it.
Checked on CPU under Triton's interpreter by tools/kv_finish_interpret.py; on the GPU by
tests/gpu/test_deepseek_kernels.py.

Shape legend: T rows, D head_dim (the K=V row), R the rope slice (the trailing channels),
P ring slots, W window.
"""

from __future__ import annotations

import torch

from epdraft.errors import ConfigError
from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

QUANT_GROUP = 64  # `fp8_ue8m0_roundtrip`'s group: DeepSeek's act_quant block


def _check(op: str, kv_TD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> tuple[int, int, int]:
    """(T, D, R) of the rows and their angles; ConfigError naming the tensors otherwise."""
    if kv_TD.dim() != 2 or cos_TR.dim() != 2 or cos_TR.shape != sin_TR.shape:
        raise ConfigError(f"{op}: kv {tuple(kv_TD.shape)}, cos {tuple(cos_TR.shape)}, sin {tuple(sin_TR.shape)}: "
                          "expected kv [T, D], cos and sin [T, R / 2]")  # fmt: skip
    T, D = kv_TD.shape
    R = 2 * cos_TR.shape[1]
    if cos_TR.shape[0] != T or not 0 < R <= D:
        raise ConfigError(f"{op}: kv {tuple(kv_TD.shape)}, cos {tuple(cos_TR.shape)}: expected cos and sin "
                          f"[{T}, R / 2] with 0 < R <= D = {D}")  # fmt: skip
    if not kv_TD.dtype.is_floating_point or cos_TR.dtype != torch.float32 or sin_TR.dtype != torch.float32:
        raise ConfigError(f"{op}: kv is {kv_TD.dtype}, cos {cos_TR.dtype}, sin {sin_TR.dtype}: expected a float kv "
                          "and fp32 cos and sin (what `DeepseekDSparkAttention.rope` returns)")  # fmt: skip
    if any(t.stride(-1) != 1 for t in (kv_TD, cos_TR, sin_TR)):
        raise ConfigError(f"{op}: kv, cos and sin need a contiguous last dim")
    return T, D, R


def _launch(kv_TD, cos_TR, sin_TR, slots_T, positions_T, out, stride_op, stride_ow, window, *, fake_quant, ring):
    from epdraft.kernels.step._kv_finish_triton import kv_finish_kernel

    T, D = kv_TD.shape
    R = 2 * cos_TR.shape[1]
    nope = D - R
    group = QUANT_GROUP if nope % QUANT_GROUP == 0 else nope
    num_groups = nope // group  # 0 when R = D (group is then 64)
    if T:
        kv_finish_kernel[(T,)](
            kv_TD, cos_TR, sin_TR, slots_T, positions_T, out,
            kv_TD.stride(0), cos_TR.stride(0), stride_op, stride_ow, window,
            D=D, R=R, GROUP=group, NUM_GROUPS=num_groups, GROUPS_P=next_pow2(max(num_groups, 1)),
            GROUP_P=next_pow2(group), HALF_P=next_pow2(R // 2), FAKE_QUANT=fake_quant and nope > 0,
            RING=ring, num_warps=1 if D <= 128 else 2, **launch.kwargs(kv_TD.device),
        )  # fmt: skip


def kv_finish(kv_TD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, *, fake_quant: bool) -> torch.Tensor:
    """The finished K=V rows [T, D] in kv's dtype (see the module docstring for what they equal).

    kv_TD [T, D]: the rows after `kv_norm`, in the model's dtype; cos_TR / sin_TR [T, R / 2] fp32:
    each row's angles (`DeepseekDSparkAttention.rope` of its position); `fake_quant`: the FP8 round
    trip of channels [0, D - R) (`kv_fake_quant`). T may be 0.

    Raises:
        ConfigError: shapes or dtypes other than these, a last dim that is not contiguous, or
            gradients asked for (no backward).
    """
    launch.refuse_autograd("kv_finish", kv_TD)
    _check("kv_finish", kv_TD, cos_TR, sin_TR)
    out = torch.empty_like(kv_TD, memory_format=torch.contiguous_format)
    _launch(kv_TD, cos_TR, sin_TR, out, out, out, out.stride(0), 0, 1, fake_quant=fake_quant, ring=False)
    return out


def kv_finish_store(
    kv_TD: torch.Tensor,
    cos_TR: torch.Tensor,
    sin_TR: torch.Tensor,
    slots_T: torch.Tensor,
    positions_T: torch.Tensor,
    ring_PWD: torch.Tensor,
    *,
    fake_quant: bool,
) -> None:
    """`kv_finish`'s rows written in place to ring_PWD[slots_T[t], positions_T[t] % W] (cast to the
    ring's dtype after kv's): a commit's `WindowKVPool.store` of one layer.

    slots_T, positions_T [T] integer on kv's device (`RequestSlots.placement`'s); ring_PWD [P, W, D]
    (`WindowKVPool.kv[layer]`), its last dim contiguous. Rows of a program must land on distinct
    ring rows for the result not to depend on the order of the writes (`placement` sees to it; the
    pad slot takes the rest, whose content is never read). No host sync.

    Raises:
        ConfigError: as `kv_finish`, or a ring or index tensors of other shapes.
    """
    launch.refuse_autograd("kv_finish_store", kv_TD)
    T, D, _ = _check("kv_finish_store", kv_TD, cos_TR, sin_TR)
    ring_ok = ring_PWD.dim() == 3 and ring_PWD.shape[2] == D and ring_PWD.stride(-1) == 1
    if not ring_ok or not ring_PWD.dtype.is_floating_point:
        raise ConfigError(f"kv_finish_store: ring {tuple(ring_PWD.shape)} {ring_PWD.dtype}: expected a float "
                          f"[P, W, {D}] with a contiguous last dim")  # fmt: skip
    if slots_T.shape != (T,) or positions_T.shape != (T,) or any(
        t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool for t in (slots_T, positions_T)
    ):
        raise ConfigError(f"kv_finish_store: slots {tuple(slots_T.shape)} {slots_T.dtype}, positions "
                          f"{tuple(positions_T.shape)} {positions_T.dtype}: expected integer [{T}] each "
                          "(one per kv row)")  # fmt: skip
    slots_T, positions_T = slots_T.contiguous(), positions_T.contiguous()  # read as flat arrays
    _launch(kv_TD, cos_TR, sin_TR, slots_T, positions_T, ring_PWD, ring_PWD.stride(0), ring_PWD.stride(1),
            ring_PWD.shape[1], fake_quant=fake_quant, ring=True)  # fmt: skip
