"""Run the fused-experts GEMM kernels on CPU under Triton's interpreter, against `experts_reference`.

Checks the kernels' arithmetic and addressing (rows, K tiles, split-K partials, FP8 block scales,
MXFP4 blocks and scales, both MXFP4 upcasts) where no GPU is at hand; it says nothing about speed,
and it does not replace tests/gpu. Needs Triton (any platform: pip install triton into a scratch dir):

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tsite:. python tools/kernel_interpret.py

What the interpreter cannot do is worked around here, and only here:
- it holds bf16 as raw uint16 and multiplies and dots those bits as integers: here bf16 products
  are taken in fp32 and rounded to bf16 once (what mul.rn.bf16x2 does) and bf16 dots are taken in
  fp32 (each product of two bf16 is exact there, as in the tensor cores). The first table runs
  activations and bf16 weights in fp32 all the same (FP8 and MXFP4 weights are upcast to the
  activations' dtype by the kernels); the MXFP4 bits path reads bf16 activations as int32 pairs,
  so the second table runs both MXFP4 upcasts on bf16 activations;
- inline PTX does not run there: the bits path's asm runs in `tests.kernels.ptx_emulator`, which
  executes the PTX text itself (elementwise, `pack` elements per instance, as Triton packs them);
- `tl.dot_scaled` does not run there: it is replaced by its documented semantics (rhs [K/2, N]
  uint8 with element 2j in the low nibble, scales [N, K/32] e8m0), so its MXFP4 check covers the
  kernels' addressing, not Triton's own upcast;
- the routing setup (one launch whose programs wait on each other) is built in Python;
- Triton 3.6's interpreter turns scalar loop bounds into 1-element arrays that numpy 2 refuses as
  an index; `__index__` is patched to take their element.
"""

from __future__ import annotations

import os

import torch


def _patch_interpreter() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    def dot_scaled(lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, acc=None, **_):
        def e2m1(code):
            m = (code & 7).to(tl.float32)  # 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6
            mag = tl.where(m < 4, m * 0.5, tl.where(m < 6, m - 2.0, 2.0 * m - 8.0))
            return tl.where((code & 8) != 0, -mag, mag)

        half_k, n = rhs.shape
        w = tl.reshape(tl.permute(tl.join(e2m1(rhs & 15), e2m1(rhs >> 4)), (0, 2, 1)), (2 * half_k, n))
        scale = tl.exp2(tl.trans(rhs_scale).to(tl.float32) - 127.0)  # [K/32, N]
        groups = 2 * half_k // 32
        scale = tl.reshape(tl.broadcast_to(tl.reshape(scale, (groups, 1, n)), (groups, 32, n)), (2 * half_k, n))
        return tl.dot(lhs, (w * scale).to(lhs.dtype), acc)

    tl.dot_scaled = dot_scaled

    import numpy as np
    import torch

    from tests.kernels.ptx_emulator import run_elementwise

    builder = interpreter.InterpreterBuilder
    TensorHandle = interpreter.TensorHandle

    def bf16_to_fp32(data):
        return (data.astype(np.uint32) << 16).view(np.float32)

    def fp32_to_bf16(data):
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    class Results:
        def __init__(self, handles):
            self.handles = handles

        def get_result(self, i):
            return self.handles[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        shape = np.broadcast(*[v.data for v in values]).shape
        inputs = [np.broadcast_to(v.data, shape).reshape(-1) for v in values]
        scalars = [getattr(t, "element_ty", t) for t in types]
        outs = run_elementwise(asm, constraints, inputs, [interpreter._get_np_dtype(t) for t in scalars], pack)
        return Results([TensorHandle(o.reshape(shape), t) for o, t in zip(outs, scalars)])

    fmul = builder.create_fmul

    def create_fmul(self, lhs, rhs):
        if lhs.dtype.scalar != tl.bfloat16:
            return fmul(self, lhs, rhs)
        return TensorHandle(fp32_to_bf16(bf16_to_fp32(lhs.data) * bf16_to_fp32(rhs.data)), tl.bfloat16)

    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            a, b = TensorHandle(bf16_to_fp32(a.data), tl.float32), TensorHandle(bf16_to_fp32(b.data), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_inline_asm = create_inline_asm
    builder.create_fmul = create_fmul
    builder.create_dot = create_dot


def _aligned(ids_TK: torch.Tensor, num_experts: int, block_m: int):
    """AlignedPairs built in Python: each expert's pairs in order, padded to block_m with num_pairs."""
    from epdraft.kernels.experts.align import AlignedPairs

    ids = ids_TK.reshape(-1).tolist()
    rows, labels = [], []
    for e in range(num_experts):
        group = [p for p, i in enumerate(ids) if i == e]
        group += [len(ids)] * (-len(group) % block_m)
        rows += group
        labels += [e] * (len(group) // block_m)
    return AlignedPairs(
        torch.tensor(rows + [len(ids)] * block_m, dtype=torch.int32),
        torch.tensor(labels + [0], dtype=torch.int32),
        torch.tensor([len(labels) * block_m], dtype=torch.int32),
        block_m,
        len(ids),
    )


def _run(x, ids, weights, q13, q2, act, up_split, down_split, upcast):
    from epdraft.kernels.experts.fused import down_combine, up_act
    from epdraft.kernels.experts.tables import DownConfig, UpConfig

    aligned = _aligned(ids, q13.shape[0], 16)
    h = up_act(x, aligned, q13, None, act, UpConfig(block_n=32, block_k=64, split_k=up_split), upcast)
    return down_combine(h, aligned, ids, weights, q2, None, DownConfig(block_n=32, block_k=64, split_k=down_split),
                        upcast)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (see the module docstring)")
    _patch_interpreter()
    from epdraft.config.ffn import ActivationSpec
    from epdraft.bench.tune import random_routing
    from epdraft.loading.quant import dequantize_weights, quantize_weights
    from epdraft.layers.experts import experts_reference

    E, I, H, K, T = 4, 128, 256, 2, 20
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, generator=gen) * I**-0.5
    x = torch.randn(T, H, generator=gen)
    ids, weights = random_routing(T, E, K, torch.device("cpu"), gen)
    ids[::5, 1] = -1
    act = ActivationSpec()
    splits = ((1, 1), (2, 2))
    print(f"{'weights (fp32 x)':18s} {'split up/down':>13s} {'max |dy| / mean|y|':>19s}")
    worst = 0.0
    for fmt in ("bf16", "fp8", "mxfp4"):
        q13, q2 = quantize_weights(w13, fmt), quantize_weights(w2, fmt)
        ref = experts_reference(x, ids, weights, dequantize_weights(q13, torch.float32), dequantize_weights(q2, torch.float32), act)
        for up_split, down_split in splits:
            y = _run(x, ids, weights, q13, q2, act, up_split, down_split, "dot_scaled")
            err = ((y - ref).abs().max() / ref.abs().mean()).item()
            worst = max(worst, err)
            print(f"{fmt:18s} {f'{up_split}/{down_split}':>13s} {err:>19.2e}")
    if worst > 1e-4:
        raise SystemExit(f"mismatch: {worst:.3g} > 1e-4 (fp32 throughout, only summation order differs)")

    # MXFP4 on bf16 activations, both upcasts: each against the other (the same bf16 products, in
    # another summation order) and against the bf16 reference (DESIGN.md's drift bound)
    xb = x.to(torch.bfloat16)
    q13, q2 = quantize_weights(w13, "mxfp4"), quantize_weights(w2, "mxfp4")
    ref = experts_reference(xb, ids, weights, dequantize_weights(q13, torch.bfloat16), dequantize_weights(q2, torch.bfloat16), act)
    scale = ref.float().abs().mean().item()
    print(f"{'mxfp4 (bf16 x)':18s} {'split up/down':>13s} {'bits vs dot_scaled':>19s} {'bits vs reference':>18s}")
    for up_split, down_split in splits:
        y_bits = _run(xb, ids, weights, q13, q2, act, up_split, down_split, "bits").float()
        y_ds = _run(xb, ids, weights, q13, q2, act, up_split, down_split, "dot_scaled").float()
        between = (y_bits - y_ds).abs().max().item() / scale
        vs_ref = (y_bits - ref.float()).abs()
        print(f"{'mxfp4':18s} {f'{up_split}/{down_split}':>13s} {between:>19.2e} {vs_ref.max().item() / scale:>18.2e}")
        if between > 0.02 or vs_ref.max() > 0.2 * scale or vs_ref.mean() > 0.02 * scale:
            raise SystemExit(f"mxfp4 bits path mismatch at split {up_split}/{down_split}")


if __name__ == "__main__":
    main()
