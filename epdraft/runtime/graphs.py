"""StepGraphs / CommitGraphs: the draft step, and the commit of the verified rows into the draft's
context, each captured as one CUDA graph per batch-size bucket, replayed every step.

A step's requests are padded to the smallest bucket >= the largest request count of any DP rank
(read from the agreed StepPlan, so every rank, idle ranks included, replays a graph of the same
shape and enters the same collectives). Padding rows use the pool's pad slot and are dropped.
Inputs go through one pinned host buffer, written through a numpy view made once (a few
microseconds of host time where torch's indexing costs tens); the graph's own first node copies it
to the static device buffer and records an event the host waits on before the next write, so a
replay is two host calls (that wait, usually already done, and the replay) and never waits for
the step. The MoE layers are captured with a plan whose counts are the bucket's, so their
collectives have the bucket's fixed shapes. Each readout (`Readout`: argmax, sampled, sampled with
top-k / top-p) has its own graph per bucket: an all-greedy step keeps the argmax one. A capture
runs the step once eagerly first, collectives included, so where the MoE layers communicate every
rank must capture at the same point: the bucket is agreed, but the readout is each rank's own (its
requests' sampling), so there every graph is captured at start-up (`capture`, from
`DraftRuntime.warm_up`) and a missing one is an error; a rank alone captures on first use.

A commit has no collective, so its bucket is this rank's own request count; its rows (1 ..
`rows_per_request` per request, packed) are copied into the graph's static rows and the padding
goes to the pad slot (`RequestSlots.placement`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from epdraft.dispatch import StepPlan
from epdraft.errors import EpdraftError, RequestError
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
class _Inputs:
    """A graph's integer inputs: rows of a pinned host buffer, the numpy view the host writes them
    through, and the static device copy the graph reads. The copy is the graph's first node
    (`copy_in`, called inside the capture); `copied` is an external event the graph records after
    it, so each replay records it too."""

    host: torch.Tensor
    view: np.ndarray
    device: torch.Tensor
    copied: torch.cuda.Event

    @classmethod
    def of(cls, rows: list[list[int]], device: torch.device) -> _Inputs:
        host = torch.tensor(rows, dtype=torch.long).pin_memory()
        inputs = cls(host, host.numpy(), host.to(device, non_blocking=True), torch.cuda.Event(external=True))
        inputs.copied.record()  # the copy above reads the buffer the first `write` refills
        return inputs

    def write(self, rows: list[tuple[list[int], int]]) -> None:
        """Row i := rows[i] = (values, filler for the rest), once the last replay's copy has read them."""
        self.copied.synchronize()
        view = self.view
        for i, (values, filler) in enumerate(rows):
            view[i, : len(values)] = values
            view[i, len(values) :] = filler

    def copy_in(self) -> None:
        """The host rows to the device, then `copied`: recorded into the graph being captured."""
        self.device.copy_(self.host, non_blocking=True)
        self.copied.record()


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: _Inputs  # rows: slots, anchors
    output: DraftStep
    firsts: dict[int, DraftStep] = dataclasses.field(default_factory=dict)  # output.first(n), made once per n

    def first(self, n: int) -> DraftStep:
        view = self.firsts.get(n)
        if view is None:
            view = self.firsts[n] = self.output.first(n)
        return view


class StepGraphs:
    """Captures and replays `step(slots_N, anchors_N, plan, readout) -> DraftStep` per bucket and readout.

    step: the draft step over static inputs (`draft.step` bound to its pool and heads).
    pad_slot: the slot padding rows read. buckets: ascending request counts.
    capture_on_first_use: whether `run` captures a graph it lacks (False where the MoE layers
        communicate: see the module docstring).
    """

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor, StepPlan, Readout], DraftStep],
        *,
        pad_slot: int,
        buckets: tuple[int, ...],
        block_size: int,
        device: torch.device,
        capture_on_first_use: bool = True,
    ):
        self.step = step
        self.pad_slot = pad_slot
        self.buckets = buckets
        self.block_size = block_size
        self.device = device
        self.capture_on_first_use = capture_on_first_use
        self._captured: dict[tuple[int, Readout], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket(self, plan: StepPlan) -> int:
        """The bucket every rank agrees on for this step: from the largest row count in the plan."""
        return bucket_for(self.buckets, -(-plan.max_count // self.block_size))

    def run(
        self, slots: list[int], anchors: list[int], plan: StepPlan, *, readout: Readout = Readout.ARGMAX
    ) -> DraftStep:
        """The step's output for these len(slots) requests, on the device, from the graph of the
        bucket and readout (captured on first use where `capture_on_first_use`); views of the
        graph's static outputs, overwritten by the next replay of that graph.

        Raises:
            EpdraftError: the graph was never captured and may not be now.
        """
        b = self.bucket(plan)
        captured = self._captured.get((b, readout))
        if captured is None:
            if not self.capture_on_first_use:
                raise EpdraftError(
                    f"no CUDA graph of the draft step for bucket {b} with the {readout.value} readout: the MoE "
                    "layers communicate, so every rank captures every graph at start-up; call DraftRuntime.warm_up "
                    "on every rank before the first step"
                )
            captured = self._capture(b, readout, plan.step, plan.ranks, slots, anchors)
        captured.inputs.write([(slots, self.pad_slot), (anchors, 0)])
        captured.graph.replay()
        return captured.first(len(slots))

    def capture(self, b: int, readout: Readout, ranks: tuple[int, ...]) -> None:
        """Capture bucket `b`'s graph for `readout` now, over padding rows, unless it already is
        (start-up: where the MoE layers communicate, every rank of `ranks` at the same point)."""
        if (b, readout) not in self._captured:
            self._capture(b, readout, -1, ranks, [], [])

    def _capture(
        self, b: int, readout: Readout, step: int, ranks: tuple[int, ...], slots: list[int], anchors: list[int]
    ) -> _Captured:
        bucket_plan = StepPlan(step=step, ranks=ranks, counts=(b * self.block_size,) * len(ranks))
        pad = b - len(slots)
        inputs = _Inputs.of([list(slots) + [self.pad_slot] * pad, list(anchors) + [0] * pad], self.device)
        slots_d, anchors_d = inputs.device[0], inputs.device[1]
        # Warm up on a side stream (lazy inits, Triton autotuning, allocator) before capturing.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(slots_d, anchors_d, bucket_plan, readout)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            inputs.copy_in()
            output = self.step(slots_d, anchors_d, bucket_plan, readout)
        log.info("captured the draft step (%s readout) for %d requests (bucket %d)", readout.value, len(slots), b)
        captured = _Captured(graph, inputs, output)
        self._captured[b, readout] = captured
        return captured


@dataclasses.dataclass
class _CapturedCommit:
    graph: torch.cuda.CUDAGraph
    inputs: _Inputs  # rows: slots, counts
    features: torch.Tensor  # [b * rows_per_request, F]: the prefix of CommitGraphs' shared rows


class CommitGraphs:
    """Captures and replays `write(slots_N, counts_N, features_TF)` (a draft's `write_context` bound
    to its pool) per bucket of requests, T = bucket x `rows_per_request`.

    pad_slot: the slot padding requests name (with 0 rows). width, dtype: the rows' feature width
    and the dtype the draft's fc reads (the static rows are held in it). Every bucket's graph reads
    a prefix of one static rows buffer of the largest bucket (replays run one after another on one
    stream, so they never need two).
    """

    def __init__(
        self,
        write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        *,
        pad_slot: int,
        buckets: tuple[int, ...],
        rows_per_request: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.write = write
        self.pad_slot, self.buckets, self.rows_per_request = pad_slot, buckets, rows_per_request
        self.width, self.dtype, self.device = width, dtype, device
        self._captured: dict[int, _CapturedCommit] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._rows = torch.zeros(max(buckets) * rows_per_request, width, dtype=dtype, device=device)

    def run(self, slots: list[int], counts: list[int], features_TF: torch.Tensor) -> None:
        """Commit request i's counts[i] rows, packed in features_TF [sum(counts), F] on the device,
        into slots[i] (host lists, len >= 1; each count at most `rows_per_request`): the rows are
        copied into the bucket's static rows and its graph replayed, with no host sync."""
        over = [c for c in counts if c > self.rows_per_request]
        if over:
            raise RequestError(
                f"commit: {max(over)} rows for one request; a step commits at most {self.rows_per_request} "
                "(the anchor and every draft)"
            )
        b = bucket_for(self.buckets, len(slots))
        captured = self._captured.get(b)
        if captured is None:
            captured = self._capture(b)
        captured.inputs.write([(slots, self.pad_slot), (counts, 0)])
        captured.features[: features_TF.shape[0]].copy_(features_TF)
        captured.graph.replay()

    def capture(self, b: int) -> None:
        """Capture bucket `b` now (start-up), unless it already is."""
        if b not in self._captured:
            self._capture(b)

    def _capture(self, b: int) -> _CapturedCommit:
        # all padding: the warm-up run below writes junk rows to the pad slot only
        inputs = _Inputs.of([[self.pad_slot] * b, [0] * b], self.device)
        ints = inputs.device
        features = self._rows[: b * self.rows_per_request]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.write(ints[0], ints[1], features)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            inputs.copy_in()
            self.write(ints[0], ints[1], features)
        log.info("captured the draft context commit for %d requests", b)
        captured = _CapturedCommit(graph, inputs, features)
        self._captured[b] = captured
        return captured
