"""Routed experts' math in plain torch: the reference every kernel and layout is held against.

Weight layout (one layout for every export naming; the loader converts):
    w13_eNH [e, 2F, H]: gate rows [0, F), up rows [F, 2F) (not interleaved)
    w2_eHF  [e, H, F]
    b13_eN  [e, 2F], b2_eH [e, H]: optional expert biases (gpt-oss)
with e the experts held here and F the intermediate slice held here (F = I / moe_tp).
"""

from __future__ import annotations

import torch

from epdraft.config.ffn import ActivationSpec
from epdraft.layers.activations import gated_act


def experts_reference(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13_eNH: torch.Tensor,
    w2_eHF: torch.Tensor,
    act: ActivationSpec,
    b13_eN: torch.Tensor | None = None,
    b2_eH: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * (down_e(act(gate_e x, up_e x)) + b2_e) over the pairs with e = ids[t,j] >= 0.

    Args:
        x_TH: [T, H] tokens (or dispatched rows), T may be 0.
        ids_TK: [T, K] int, *local* expert ids in [0, e); -1 = not computed here (another rank's
            expert, or a padded row).
        weights_TK: [T, K] fp32 combine weights.
    Returns:
        [T, H] in x's dtype, accumulated in fp32 over each row's pairs in ascending expert order.
    """
    T, H = x_TH.shape
    F_ = w2_eHF.shape[-1]
    out_TH = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    flat_ids = ids_TK.reshape(-1)
    flat_w = weights_TK.reshape(-1).float()
    token_of_pair = torch.arange(T, device=x_TH.device).repeat_interleave(ids_TK.shape[1])
    for e in torch.unique(flat_ids[flat_ids >= 0]).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        rows = token_of_pair[pairs]
        gate_up = x_TH[rows] @ w13_eNH[e].T
        if b13_eN is not None:
            gate_up = gate_up + b13_eN[e]
        h = gated_act(gate_up[:, :F_], gate_up[:, F_:], act).to(x_TH.dtype)
        y = (h @ w2_eHF[e].T).float()
        if b2_eH is not None:
            y = y + b2_eH[e].float()
        out_TH.index_add_(0, rows, y * flat_w[pairs].unsqueeze(1))
    return out_TH.to(x_TH.dtype)
