"""The mHC residual's per-sublayer work (DeepSeek DSpark drafts) as four Triton launches (CUDA).

Why: the torch chain of one sublayer's mixing (`epdraft.models.hyper_connections`: fp32 casts, the
fn projection, sigmoids and 20 Sinkhorn iterations of row and column sums over 4 x 4 matrices, the
collapse and the write-back) is ~130 kernels; six sublayers made most of the V4.1-Flash draft
step's ~1350 launches, 4.4x its floor at one request (docs/performance.md). Here it is:

    hc_mixes       = normalized_projection + split_mixes (split-K partials, then one program per
                     16 rows sums them in order and runs the sigmoids and Sinkhorn)
    hc_collapse    = collapse
    hc_write_back  = write_back

Each equals that torch function to fp32 rounding order (tests/gpu/test_deepseek_kernels.py). Grids
depend on shapes only; the split width depends on the stream width alone, so a row's mixes do not
depend on the rows around it. No launch reads a tensor on the host: a CUDA graph can hold them.
"""

from __future__ import annotations

import torch

from epdraft.kernels import launch
from epdraft.kernels.launch import next_pow2

_ROWS = 16  # rows per program of the projection and the mixes (tl.dot's smallest tile)
_BLOCK_K = 64
_SPLIT_COLS = 256  # columns per projection split: X = 4 x 4096 gives 64 programs per 16 rows
_BLOCK_H = 512


def fits(hc_mult: int) -> bool:
    """Whether these launches take `hc_mult` streams (a power of two: the streams are one tile).
    They run where `StepKernels.step_ops` is "triton" (`ops.unsupported_reason`)."""
    return hc_mult & (hc_mult - 1) == 0


def hc_mixes(
    x_NcH: torch.Tensor,
    fn_MX: torch.Tensor,
    scale_3: torch.Tensor,
    base_M: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [N, c], post [N, c], comb [N, c, c]) fp32 of streams x_NcH [N, c, H] (contiguous, any
    float dtype): `split_mixes(normalized_projection(x, fn, norm_eps), scale, base, ...)`."""
    launch.refuse_autograd("hc_mixes", x_NcH, fn_MX, scale_3, base_M)
    from epdraft.kernels.step._hc_triton import hc_mixes_kernel, hc_project_kernel

    x_NcH = x_NcH.contiguous()
    N, c, H = x_NcH.shape
    X, M = c * H, fn_MX.shape[0]
    f32 = dict(dtype=torch.float32, device=x_NcH.device)
    pre, post, comb = torch.empty(N, c, **f32), torch.empty(N, c, **f32), torch.empty(N, c, c, **f32)
    if N == 0:
        return pre, post, comb
    x = x_NcH.reshape(N, X)
    splits = -(-X // _SPLIT_COLS)
    partials = torch.empty(splits, N, M + 1, **f32)
    kw = launch.kwargs(x_NcH.device)
    hc_project_kernel[(-(-N // _ROWS), splits)](
        x, fn_MX, partials, N, X, M, x.stride(0), fn_MX.stride(0), _SPLIT_COLS,
        BLOCK_R=_ROWS, BLOCK_M=next_pow2(M), BLOCK_K=_BLOCK_K, num_warps=4, **kw,
    )  # fmt: skip
    hc_mixes_kernel[(-(-N // _ROWS),)](
        partials, scale_3, base_M, pre, post, comb, N, splits, X, sinkhorn_iters, norm_eps, hc_eps,
        C=c, BLOCK_R=_ROWS, num_warps=4, **kw,
    )  # fmt: skip
    return pre, post, comb


def hc_collapse(x_NcH: torch.Tensor, pre_Nc: torch.Tensor) -> torch.Tensor:
    """[N, H] in x's dtype: sum_j pre_j x_j in fp32 (`collapse`); x_NcH contiguous, pre_Nc fp32."""
    launch.refuse_autograd("hc_collapse", x_NcH, pre_Nc)
    from epdraft.kernels.step._hc_triton import hc_collapse_kernel

    x_NcH = x_NcH.contiguous()
    N, c, H = x_NcH.shape
    out = torch.empty(N, H, dtype=x_NcH.dtype, device=x_NcH.device)
    if N:
        hc_collapse_kernel[(N, -(-H // _BLOCK_H))](
            x_NcH, pre_Nc.contiguous(), out, H, x_NcH.stride(0), out.stride(0),
            C=c, BLOCK_H=_BLOCK_H, num_warps=4, **launch.kwargs(x_NcH.device),
        )  # fmt: skip
    return out


def hc_write_back(
    y_NH: torch.Tensor, x_NcH: torch.Tensor, post_Nc: torch.Tensor, comb_Ncc: torch.Tensor
) -> torch.Tensor:
    """New streams [N, c, H] in x's dtype: post_k y + sum_j comb[j, k] x_j in fp32 (`write_back`)."""
    launch.refuse_autograd("hc_write_back", y_NH, x_NcH, post_Nc, comb_Ncc)
    from epdraft.kernels.step._hc_triton import hc_write_back_kernel

    x_NcH = x_NcH.contiguous()
    N, c, H = x_NcH.shape
    out = torch.empty(N, c, H, dtype=x_NcH.dtype, device=x_NcH.device)
    if N:
        y = y_NH if y_NH.stride(-1) == 1 else y_NH.contiguous()
        hc_write_back_kernel[(N, -(-H // _BLOCK_H))](
            y, x_NcH, post_Nc.contiguous(), comb_Ncc.contiguous(), out, H, y.stride(0), x_NcH.stride(0),
            C=c, BLOCK_H=_BLOCK_H, num_warps=4, **launch.kwargs(x_NcH.device),
        )  # fmt: skip
    return out
