"""What the GPU all-to-all adapters (DeepEP, Mooncake EP) share: capability checks, the one-row pad
for idle ranks, and the view of a fixed per-expert receive buffer as dispatched rows."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
import torch.distributed as dist

from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.layout import MoeLayout


def gpu_a2a_reason(layout: MoeLayout, group: dist.ProcessGroup, module: str, install: str) -> str | None:
    """Why a CUDA all-to-all module cannot serve this group, or None (package, CUDA, NCCL, moe_tp).

    `find_spec` of a submodule imports its parent package (not the CUDA extension itself).
    """
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is None or importlib.util.find_spec(module) is None:
        return f"{module} is not installed: {install}"
    if not torch.cuda.is_available():
        return f"{package} needs CUDA GPUs and none is visible"
    backend = dist.get_backend(group)
    if backend != dist.Backend.NCCL:
        return f"the MoE group's backend is {backend}: {package} needs an NCCL group"
    if layout.tp_size > 1:
        return f"{package} sends tokens to whole experts; draft.moe_tp = {layout.tp_size} splits them (use moe_layout = 'gather')"
    return None


@dataclasses.dataclass(frozen=True)
class BackendRows(Dispatched):
    """Dispatched rows plus what the backend's combine needs back.

    topk_ids_TK / topk_weights_TK: what was sent (padded to >= 1 row); backend_handle: the
    backend's own handle; masked_shape: (e, M, H) of a fixed receive buffer, None for exact-count
    (DeepEP normal) rows.
    """

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    backend_handle: Any
    masked_shape: tuple[int, int, int] | None = None


def pad_idle(
    x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, id_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs with at least one row: a 0-row rank sends one zero row routed nowhere (ids -1).

    DeepEP rejects [0, K] ids (`topk_idx_ptr != 0` host assert); the dummy row goes to no expert
    and combine slices it off, so it never reaches the caller.
    """
    ids_TK = topk_ids_TK.to(id_dtype)
    if x_TH.shape[0] > 0:
        return x_TH, ids_TK, topk_weights_TK.float()
    K = topk_ids_TK.shape[1]
    return (
        x_TH.new_zeros(1, x_TH.shape[1]),
        torch.full((1, K), -1, dtype=id_dtype, device=x_TH.device),
        torch.zeros(1, K, dtype=torch.float32, device=x_TH.device),
    )


def masked_rows(recv_x_eMH: torch.Tensor, recv_count_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """View a per-expert receive buffer [e, M, H] (first recv_count[j] slots of expert j valid) as rows.

    Returns rows_RH [e*M, H], ids_R1 (local expert j, -1 on unused slots) and weights_R1 of 1: the
    fixed-buffer combines apply the top-k weights themselves.
    """
    e, M, H = recv_x_eMH.shape
    slots_eM = torch.arange(M, device=recv_x_eMH.device).expand(e, M)
    experts_eM = torch.arange(e, device=recv_x_eMH.device).unsqueeze(1).expand(e, M)
    valid_eM = slots_eM < recv_count_e.to(slots_eM.dtype).unsqueeze(1)
    ids_R1 = torch.where(valid_eM, experts_eM, -1).reshape(e * M, 1)
    weights_R1 = torch.ones(e * M, 1, dtype=torch.float32, device=recv_x_eMH.device)
    return recv_x_eMH.reshape(e * M, H), ids_R1, weights_R1
