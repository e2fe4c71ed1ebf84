"""Run the fused-experts GEMM kernels on CPU under Triton's interpreter, against `experts_reference`.

Checks the kernels' arithmetic and addressing (rows, K tiles, split-K partials, FP8 block scales,
MXFP4 blocks and scales) where no GPU is at hand; it says nothing about speed, and it does not
replace tests/gpu. Needs Triton (any platform: pip install triton into a scratch dir):

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tsite:. python tools/kernel_interpret.py

What the interpreter cannot do is worked around here, and only here:
- bf16 tiles come out wrong under the interpreter (numpy has no bf16), so activations and bf16
  weights run in fp32; FP8 and MXFP4 weights are upcast to the activations' dtype by the kernels;
- `tl.dot_scaled` does not run there: it is replaced by its documented semantics (rhs [K/2, N]
  uint8 with element 2j in the low nibble, scales [N, K/32] e8m0), so the MXFP4 check covers the
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


def _aligned(ids_TK: torch.Tensor, num_experts: int, block_m: int):
    """AlignedPairs built in Python: each expert's pairs in order, padded to block_m with num_pairs."""
    from epdraft.kernels.align import AlignedPairs

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


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (see the module docstring)")
    _patch_interpreter()
    from epdraft.config.ffn import ActivationSpec
    from epdraft.kernels.fused_moe import down_combine, up_act
    from epdraft.kernels.tuning import DownConfig, UpConfig, quantize_weights, random_routing
    from epdraft.layers.experts import experts_reference

    E, I, H, K, T = 4, 128, 256, 2, 20
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, generator=gen) * I**-0.5
    x = torch.randn(T, H, generator=gen)
    ids, weights = random_routing(T, E, K, torch.device("cpu"), gen)
    ids[::5, 1] = -1
    act = ActivationSpec()
    print(f"{'weights':8s} {'split up/down':>13s} {'max |dy| / mean|y|':>19s}")
    worst = 0.0
    for fmt in ("bf16", "fp8", "mxfp4"):
        q13, q2 = quantize_weights(w13, fmt), quantize_weights(w2, fmt)
        ref = experts_reference(x, ids, weights, q13.dequantized(torch.float32), q2.dequantized(torch.float32), act)
        for up_split, down_split in ((1, 1), (2, 2)):
            aligned = _aligned(ids, E, 16)
            h = up_act(x, aligned, q13, None, act, UpConfig(block_n=32, block_k=64, split_k=up_split))
            y = down_combine(h, aligned, ids, weights, q2, None, DownConfig(block_n=32, block_k=64, split_k=down_split))
            err = ((y - ref).abs().max() / ref.abs().mean()).item()
            worst = max(worst, err)
            print(f"{fmt:8s} {f'{up_split}/{down_split}':>13s} {err:>19.2e}")
    if worst > 1e-4:
        raise SystemExit(f"mismatch: {worst:.3g} > 1e-4 (fp32 throughout, only summation order differs)")


if __name__ == "__main__":
    main()
