"""`alltoall` layout, `mooncake` backend: Mooncake EP's fixed-buffer `mooncake_ep_buffer.Buffer`.

DeepEP-low-latency style: dispatch fills a [e, R*T, H] receive buffer, combine applies the top-k
weights. Every call carries `active_ranks`; Mooncake zeroes a rank that timed out and then returns
its contributions as zeros, so combine checks it and raises instead of returning a silently wrong
sum. Contract: Mooncake `docs/source/api-reference/python/ep-backend.md` (CUDA wheels only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epdraft.dispatch.base import Dispatched
from epdraft.dispatch.masked import BackendRows, gpu_a2a_reason, masked_rows, pad_idle
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.rows import group_counts
from epdraft.dispatch.layout import MoeLayout
from epdraft.errors import ConfigError, ParallelError

INSTALL = "pip install 'epdraft[mooncake-cuda13]' (Mooncake EP ships only in the CUDA builds)"
_MAX_TOKENS_PER_RANK = 1024
_TIMEOUT_US = 30_000_000  # a peer silent for 30 s is dead, not slow (from the second call: the first waits
# as long as the slowest rank's first step takes, its kernels compiled on the way, as SGLang's does)


class MooncakeDispatcher:
    """Mooncake EP dispatch/combine over the EP group (NCCL, CUDA, bf16 rows, H % 128 == 0)."""

    def __init__(self, layout: MoeLayout, group: dist.ProcessGroup):
        try:
            from mooncake.mooncake_ep_buffer import Buffer
        except ImportError as e:
            raise ConfigError(f"draft.a2a_backend = 'mooncake' needs Mooncake EP: {INSTALL}") from e
        self.layout = layout
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        R = len(self.ranks)
        num_bytes = Buffer.get_ep_buffer_size_hint(layout.max_rows_per_rank, layout.hidden_size, R, layout.num_experts)
        self.buffer = Buffer(group, num_bytes)
        self.active_ranks = torch.ones(R, dtype=torch.int32, device=torch.cuda.current_device())
        self.timeout_us = -1  # none until the first combine has returned

    @staticmethod
    def unsupported_reason(layout: MoeLayout, group: dist.ProcessGroup) -> str | None:
        reason = gpu_a2a_reason(layout, group, "mooncake.mooncake_ep_buffer", INSTALL)
        if reason is not None:
            return reason
        if layout.hidden_size % 128:
            return f"hidden size {layout.hidden_size}: Mooncake EP needs a multiple of 128"
        if not 0 < layout.max_rows_per_rank <= _MAX_TOKENS_PER_RANK:
            return f"max_rows_per_rank = {layout.max_rows_per_rank}: Mooncake EP sizes its buffer for 1..{_MAX_TOKENS_PER_RANK}"
        return None

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, plan: StepPlan | None
    ) -> BackendRows:
        """Rows of the [e, R*T, H] receive buffer, one local expert id per row (-1 = unused), weight 1."""
        T = x_TH.shape[0]
        counts = group_counts(plan, self.group, T)
        if x_TH.dtype != torch.bfloat16:
            raise ParallelError(f"mooncake dispatch: x is {x_TH.dtype}, Mooncake EP moves bf16 rows")
        if sum(counts) == 0:  # the whole group agrees (same plan): no collective
            return BackendRows(x_TH, topk_ids_TK, topk_weights_TK, T, topk_ids_TK, topk_weights_TK, backend_handle=None)
        if max(counts) > self.layout.max_rows_per_rank:
            raise ParallelError(
                f"step {plan.step}: {max(counts)} rows on one rank exceed mooncake max_rows_per_rank = "
                f"{self.layout.max_rows_per_rank}"
            )
        x, ids, weights = pad_idle(x_TH, topk_ids_TK, topk_weights_TK, torch.int64)
        recv_x, recv_count, handle, _, _ = self.buffer.dispatch(
            x, ids, self.active_ranks, self.layout.max_rows_per_rank, self.layout.num_experts, self.timeout_us,
            use_fp8=False,
        )
        rows, ids_R1, weights_R1 = masked_rows(recv_x, recv_count)
        return BackendRows(rows, ids_R1, weights_R1, T, ids, weights, handle, tuple(recv_x.shape))

    def combine(self, expert_out_RH: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """Weighted sum of each token's experts, [T, H]; raises ParallelError if a peer timed out."""
        assert isinstance(handle, BackendRows), type(handle)
        if handle.backend_handle is None:  # the whole group had 0 rows
            return expert_out_RH
        combined, _, _ = self.buffer.combine(
            expert_out_RH.view(handle.masked_shape),
            handle.topk_ids_TK,
            handle.topk_weights_TK,
            self.active_ranks,
            self.timeout_us,
            handle.backend_handle,
        )
        self.timeout_us = _TIMEOUT_US
        lost = (self.active_ranks == 0).nonzero().flatten().tolist()
        if lost:
            raise ParallelError(f"mooncake EP: ranks {[self.ranks[i] for i in lost]} timed out in dispatch/combine")
        return combined[: handle.num_tokens]

    def close(self) -> None:
        """Drop the EP buffer (Mooncake frees it with the object)."""
        del self.buffer
