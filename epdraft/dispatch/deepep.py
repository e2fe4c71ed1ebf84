"""`alltoall` layout, `deepep` backend: DeepEP's legacy `deep_ep.Buffer` (normal or low-latency kernels).

Normal: exact-count dispatch (`get_dispatch_layout` + `dispatch`, a CPU sync on the receive count),
rows arrive with local ids (-1 = not here) and weights; experts apply the weights and combine is an
unweighted sum. Low-latency: fixed [e, R*T, H] receive buffer (no CPU sync, graph-capturable),
combine applies the weights. The buffer belongs to this dispatcher: `close()` destroys it.
Contract: deep_ep v1 `Buffer` (docs/legacy.md); intranode normal needs NVLink, LL needs RDMA.
"""

from __future__ import annotations

import importlib.metadata
import os

import torch
import torch.distributed as dist

from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.masked import BackendRows, gpu_a2a_reason, masked_rows, pad_idle
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.rows import group_counts
from epdraft.dispatch.layout import MoeLayout
from epdraft.errors import ConfigError, ParallelError

# Not an extra: each sgl-deep-ep release pins one torch (0.1.2.post1: torch==2.14.1, CUDA 13) and
# would replace the user's; README's Extras table says how to match them.
INSTALL = "pip install sgl-deep-ep built for this torch (0.1.2.post1 pins torch 2.14.1, CUDA 13; README: Extras)"
_NORMAL_INTERNODE_NODES = (2, 3, 4, 6, 8, 12, 16, 18, 20)  # R / 8 with tuned configs
_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # hidden sizes the LL kernels are built for
_LL_HIDDEN_SGL = (3584,)  # added by SGLang's build (the sgl-deep-ep wheel), absent from DeepEP's own
_QP_DEPTH = 1024  # NVSHMEM_QP_DEPTH unless set: DeepEP sets this default before NVSHMEM starts
_MAX_TOPK = 32
_LL_MAX_TOPK = 11


class DeepEPDispatcher:
    """DeepEP dispatch/combine over the EP group (NCCL, CUDA, bf16 rows)."""

    def __init__(self, layout: MoeLayout, group: dist.ProcessGroup):
        try:
            import deep_ep
        except ImportError as e:
            raise ConfigError(f"draft.a2a_backend = 'deepep' needs DeepEP: {INSTALL}") from e
        self.layout = layout
        self.group = group
        self.id_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        R = dist.get_world_size(group)
        if layout.low_latency:
            rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
                layout.max_rows_per_rank, layout.hidden_size, R, layout.num_experts
            )
            self.buffer = deep_ep.Buffer(
                group,
                0,
                rdma_bytes,
                low_latency_mode=True,
                num_qps_per_rank=layout.num_local_experts,
                explicitly_destroy=True,
            )
        else:
            hidden_bytes = layout.hidden_size * 2  # bf16 rows
            configs = (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R))
            nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, R) for c in configs)
            rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, R) for c in configs) if R > 8 else 0
            self.buffer = deep_ep.Buffer(group, nvl_bytes, rdma_bytes, explicitly_destroy=True)

    @staticmethod
    def unsupported_reason(layout: MoeLayout, group: dist.ProcessGroup) -> str | None:
        reason = gpu_a2a_reason(layout, group, "deep_ep", INSTALL)
        if reason is not None:
            return reason
        R = dist.get_world_size(group)
        if layout.hidden_size % 8:
            return f"hidden size {layout.hidden_size}: DeepEP needs bf16 rows of a multiple of 16 bytes"
        if layout.low_latency:
            return _low_latency_reason(layout, R)
        if not (R in (2, 4, 8) or (R % 8 == 0 and R // 8 in _NORMAL_INTERNODE_NODES)):
            return f"{R} EP ranks: DeepEP normal kernels take 2, 4, 8 per node or 8 x {_NORMAL_INTERNODE_NODES}"
        if layout.top_k > _MAX_TOPK:
            return f"top_k = {layout.top_k}: DeepEP takes at most {_MAX_TOPK}"
        return None

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None
    ) -> BackendRows:
        """Send this rank's rows (global expert ids) to their experts' owners.

        Normal: rows_RH [R, H] with ids_RK local (-1 = not here) and weights_RK. Low-latency:
        rows of the [e, R*T, H] buffer, one local id per row (-1 = unused slot), weight 1.
        """
        T = x_TH.shape[0]
        counts = group_counts(plan, self.group, T)
        if x_TH.dtype != torch.bfloat16:
            raise ParallelError(f"deepep dispatch: x is {x_TH.dtype}, DeepEP moves bf16 rows")
        if sum(counts) == 0:  # the whole group agrees (same plan): no collective
            return BackendRows(x_TH, topk_ids_TK, topk_weights_TK, T, topk_ids_TK, topk_weights_TK, backend_handle=None)
        x, ids, weights = pad_idle(x_TH, topk_ids_TK, topk_weights_TK, self.id_dtype)
        if self.layout.low_latency:
            if max(counts) > self.layout.max_rows_per_rank:
                raise ParallelError(
                    f"step {plan.step}: {max(counts)} rows on one rank exceed deepep max_rows_per_rank = "
                    f"{self.layout.max_rows_per_rank}"
                )
            recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
                x, ids, self.layout.max_rows_per_rank, self.layout.num_experts, use_fp8=False
            )
            rows, ids_R1, weights_R1 = masked_rows(recv_x, recv_count)
            return BackendRows(rows, ids_R1, weights_R1, T, ids, weights, handle, tuple(recv_x.shape))
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids, self.layout.num_experts)
        recv_x, recv_ids, recv_weights, _, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=ids,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        return BackendRows(recv_x, recv_ids.long(), recv_weights, T, ids, weights, handle)

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Return [T, H] summed over each token's experts (the idle rank's dummy row sliced off)."""
        assert isinstance(handle, BackendRows), type(handle)
        if handle.backend_handle is None:  # the whole group had 0 rows
            return expert_out_RH
        if handle.masked_shape is not None:
            combined, _, _ = self.buffer.low_latency_combine(
                expert_out_RH.view(handle.masked_shape), handle.topk_ids_TK, handle.topk_weights_TK, handle.backend_handle
            )
        else:
            combined, _, _ = self.buffer.combine(expert_out_RH, handle.backend_handle)
        return combined[: handle.num_tokens]

    def close(self) -> None:
        """Destroy the DeepEP buffer (NVLink IPC / NVSHMEM memory); every rank must call it."""
        self.buffer.destroy()


def _low_latency_reason(layout: MoeLayout, R: int) -> str | None:
    """Why DeepEP's low-latency kernels cannot take `layout` over R ranks, or None."""
    hidden = _LL_HIDDEN + (_LL_HIDDEN_SGL if _sgl_build() else ())
    if layout.hidden_size not in hidden:
        return f"hidden size {layout.hidden_size}: this DeepEP's low-latency kernels exist for {hidden}"
    if not 0 < layout.top_k <= _LL_MAX_TOPK:
        return f"top_k = {layout.top_k}: DeepEP low-latency takes 1..{_LL_MAX_TOPK}"
    T = layout.max_rows_per_rank
    if T <= 0 or (R * T) % 4:
        return f"draft.max_rows_per_rank = {T}: low-latency needs > 0 with R*T % 4 == 0 ({R} ranks)"
    depth = os.environ.get("NVSHMEM_QP_DEPTH", str(_QP_DEPTH))
    if not depth.isdigit() or 2 * (T + 1) > int(depth):
        return (f"draft.max_rows_per_rank = {T}: DeepEP low-latency needs NVSHMEM_QP_DEPTH >= 2 (T + 1) = {2 * (T + 1)}, "
                f"it is {depth}; lower the key or raise the variable")  # fmt: skip
    return None


def _sgl_build() -> bool:
    """Whether the installed `deep_ep` is SGLang's wheel (sgl-deep-ep)."""
    try:
        importlib.metadata.distribution("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
