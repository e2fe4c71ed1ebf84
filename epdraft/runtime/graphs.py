"""StepGraphs: the draft step captured as one CUDA graph per batch-size bucket, replayed every step.

A step's requests are padded to the smallest bucket >= the largest request count of any DP rank
(read from the agreed StepPlan, so every rank, idle ranks included, replays a graph of the same
shape and enters the same collectives). Padding rows use the pool's pad slot and are dropped.
Inputs go through pinned host buffers into static device buffers with asynchronous copies: a
replay never synchronizes the host. A bucket is captured the first time a step needs it, on every
rank at the same step; the MoE layers are captured with a plan whose counts are the bucket's, so
their collectives have the bucket's fixed shapes. Each readout (`Readout`: argmax, sampled,
sampled with top-k / top-p) has its own graph per bucket: an all-greedy step keeps the argmax one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from epdraft.dispatch import StepPlan
from epdraft.errors import RequestError
from epdraft.models.step import DraftStep
from epdraft.sampling import Readout

log = logging.getLogger(__name__)


def default_buckets(max_requests: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to max_requests (the padding stays under 2x, or 8 rows)."""
    small = [b for b in (1, 2, 4) if b < max_requests]
    return tuple(small + list(range(8, max_requests + 8, 8))) if max_requests > 4 else tuple(small + [max_requests])


def bucket_for(buckets: tuple[int, ...], num_requests: int) -> int:
    """The smallest bucket holding `num_requests`; RequestError past the largest."""
    for b in buckets:
        if b >= num_requests:
            return b
    raise RequestError(f"{num_requests} requests on one rank exceed the largest CUDA-graph bucket {buckets[-1]}")


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    slots_host: torch.Tensor
    anchors_host: torch.Tensor
    slots: torch.Tensor
    anchors: torch.Tensor
    output: DraftStep
    copied: torch.cuda.Event = dataclasses.field(default_factory=torch.cuda.Event)


class StepGraphs:
    """Captures and replays `step(slots_N, anchors_N, plan, readout) -> DraftStep` per bucket and readout.

    step: the draft step over static inputs (`draft.step` bound to its pool and heads).
    pad_slot: the slot padding rows read. buckets: ascending request counts.
    """

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor, StepPlan, Readout], DraftStep],
        *,
        pad_slot: int,
        buckets: tuple[int, ...],
        block_size: int,
        device: torch.device,
    ):
        self.step = step
        self.pad_slot = pad_slot
        self.buckets = buckets
        self.block_size = block_size
        self.device = device
        self._captured: dict[tuple[int, Readout], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket(self, plan: StepPlan) -> int:
        """The bucket every rank agrees on for this step: from the largest row count in the plan."""
        return bucket_for(self.buckets, -(-plan.max_count // self.block_size))

    def run(
        self, slots: list[int], anchors: list[int], plan: StepPlan, *, readout: Readout = Readout.ARGMAX
    ) -> DraftStep:
        """The step's output for these len(slots) requests, on the device, from the graph of the
        bucket and readout (captured on first use); views of the graph's static outputs,
        overwritten by the next replay of that graph."""
        b = self.bucket(plan)
        captured = self._captured.get((b, readout))
        if captured is None:
            captured = self._capture(b, readout, plan, slots, anchors)
        n = len(slots)
        captured.copied.synchronize()  # the last step's input copy has read the pinned buffers
        captured.slots_host.fill_(self.pad_slot)
        captured.slots_host[:n] = torch.tensor(slots, dtype=torch.long)
        captured.anchors_host.zero_()
        captured.anchors_host[:n] = torch.tensor(anchors, dtype=torch.long)
        captured.slots.copy_(captured.slots_host, non_blocking=True)
        captured.anchors.copy_(captured.anchors_host, non_blocking=True)
        captured.copied.record()
        captured.graph.replay()
        return captured.output.first(n)

    def _capture(self, b: int, readout: Readout, plan: StepPlan, slots: list[int], anchors: list[int]) -> _Captured:
        bucket_plan = StepPlan(step=plan.step, ranks=plan.ranks, counts=(b * self.block_size,) * len(plan.ranks))
        slots_host = torch.full((b,), self.pad_slot, dtype=torch.long, pin_memory=True)
        anchors_host = torch.zeros(b, dtype=torch.long, pin_memory=True)
        slots_host[: len(slots)] = torch.tensor(slots, dtype=torch.long)
        anchors_host[: len(anchors)] = torch.tensor(anchors, dtype=torch.long)
        slots_d = slots_host.to(self.device, non_blocking=True)
        anchors_d = anchors_host.to(self.device, non_blocking=True)
        # Warm up on a side stream (lazy inits, Triton autotuning, allocator) before capturing.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(slots_d, anchors_d, bucket_plan, readout)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.step(slots_d, anchors_d, bucket_plan, readout)
        log.info("captured the draft step (%s readout) for %d requests (bucket %d)", readout.value, len(slots), b)
        captured = _Captured(graph, slots_host, anchors_host, slots_d, anchors_d, output)
        captured.copied.record()  # the copies above read the pinned buffers that `run` refills next
        self._captured[b, readout] = captured
        return captured
