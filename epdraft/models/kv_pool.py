"""The draft's context K/V of every request of a rank, preallocated once, written in place.

`RequestSlots` is what every pool shares (slots, lengths, sampling); `KVPool` holds DFlash/DSpark's
context: per layer k, v [P, g, C, D]: P = max_requests slots plus one pad slot (the rows a CUDA-graph
bucket pads with attend to it), C = max_context + block_size rows. A request owns one slot for
its lifetime; its committed context rows [0, length) are appended by the draft's `write_context`
(a program of fixed shapes with no host sync, so a CUDA graph can hold it: `placement` says where
each packed row goes, `advance` moves the device lengths, and the host's lengths are booked apart,
never read back), and each draft step writes its block's K/V to rows [length, length + B), where
the next commit overwrites them (only verified rows ever count as context). Nothing is copied per
step and nothing already admitted is ever moved, evicted or overwritten by another request: rows a
program computes but does not keep (padding) land in the pad slot.

Each slot also holds its request's sampling parameters on the device (the pad slot greedy), so a
captured step gathers them by the same slot index as the context (`sampling_of`). `WindowKVPool`
holds a DeepSeek DSpark draft's: one K=V row per position, the last `window` of them only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import RequestError
from epdraft.kernels import launch
from epdraft.kernels.step import ops as step_ops
from epdraft.sampling import Readout, SamplingBatch

GREEDY = SamplingParams()


class RequestSlots:
    """What every pool keeps beside its rows: which request owns which slot, each slot's committed
    length (on the host and the device) and its sampling, under the limits `max_requests` /
    `max_context` (a request beyond either is refused with a RequestError naming the key). Slot
    `max_requests` is the pad slot that a CUDA-graph bucket's padding rows read.
    """

    def __init__(
        self, *, max_requests: int, max_context: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ):
        if max_requests < 1 or max_context < 1:
            raise RequestError(
                f"KV pool: draft.max_requests = {max_requests} and draft.max_context = {max_context} must be >= 1"
            )
        self.max_requests, self.max_context, self.block_size = max_requests, max_context, block_size
        self.pad_slot = max_requests
        self.dtype = dtype
        self.lengths = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self._host_lengths = [0] * (max_requests + 1)
        self._params = [GREEDY] * (max_requests + 1)
        self._sampling = SamplingBatch.of(self._params, device)  # row = slot; its `readout` is unused
        self._slots: dict[int, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))  # pop() hands out slot 0 first

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, request_id: int) -> int:
        """The slot a request owns; RequestError when it was never admitted (or was released)."""
        try:
            return self._slots[request_id]
        except KeyError:
            raise RequestError(f"request {request_id} has no KV pool slot on this rank (never added, or released)") from None

    def length(self, request_id: int) -> int:
        """Committed context rows of a request."""
        return self._host_lengths[self.slot(request_id)]

    def readout(self, request_ids: Iterable[int]) -> Readout:
        """What a step over these requests reads its drafts with (argmax when all are greedy)."""
        return Readout.of(self._params[self.slot(r)] for r in request_ids)

    def admit(self, request_id: int, sampling: SamplingParams = GREEDY) -> int:
        """Give a new request an empty slot holding its `sampling` (a sampled request carries its
        seed, see `epdraft.sampling.seeded`); RequestError naming draft.max_requests when none is free."""
        if request_id in self._slots:
            raise RequestError(f"request {request_id} is already active on this rank")
        if not self._free:
            raise RequestError(
                f"request {request_id}: the KV pool is full, {self.max_requests} requests active "
                f"(draft.max_requests = {self.max_requests})"
            )
        if not sampling.greedy and sampling.seed is None:
            raise RequestError(f"request {request_id}: sampled (temperature {sampling.temperature}) without a seed")
        slot = self._free.pop()
        self._slots[request_id] = slot
        self._set_length(slot, 0)
        self._set_sampling(slot, sampling)
        return slot

    def release(self, request_id: int) -> None:
        """Return a finished request's slot (its rows are simply overwritten by the next owner)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._set_length(slot, 0)
            self._set_sampling(slot, GREEDY)
            self._free.append(slot)

    def check_room(self, request_id: int, rows: int) -> None:
        """RequestError naming draft.max_context when `rows` more context rows do not fit the request."""
        length = self.length(request_id)
        if length + rows > self.max_context:
            raise RequestError(
                f"request {request_id}: {length} + {rows} context rows exceed draft.max_context = {self.max_context}"
            )

    def book(self, request_id: int, rows: int) -> None:
        """Advance a request's length on the host only (the device's is `advance`d by the program
        that wrote the rows: the host never reads it back)."""
        self._host_lengths[self.slot(request_id)] += rows

    def set_length(self, request_id: int, length: int) -> None:
        """Declare a request's committed context length (host and device) without writing rows: a
        rollback to a length it had, or a benchmark whose context rows are random. RequestError
        naming draft.max_context when it does not fit."""
        if not 0 <= length <= self.max_context:
            raise RequestError(
                f"request {request_id}: context length {length} outside [0, draft.max_context = {self.max_context}]"
            )
        self._set_length(self.slot(request_id), length)

    def append(
        self,
        request_ids: Sequence[int],
        features: Sequence[torch.Tensor],
        write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> None:
        """`append_packed` of each request's rows features[i] [L_i, F], given one tensor each."""
        counts = [f.shape[0] for f in features]
        self.append_packed(request_ids, counts, torch.cat(list(features)) if sum(counts) else None, write)

    def append_packed(
        self,
        request_ids: Sequence[int],
        counts: Sequence[int],
        rows_TF: torch.Tensor | None,
        write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> None:
        """The host side of appending request i's counts[i] rows, packed in order in rows_TF [sum, F]
        (None when there are none), to its context: refuse (RequestError naming draft.max_context)
        before writing anything when a request's rows do not fit, run `write(slots_N, counts_N,
        rows_TF)` (a draft's `write_context` bound to this pool, on the rows' device), then book the
        lengths."""
        for rid, n in zip(request_ids, counts):
            self.check_room(rid, n)
        if sum(counts):
            slots_N = launch.host_ints([self.slot(r) for r in request_ids], rows_TF.device)
            write(slots_N, launch.host_ints(counts, rows_TF.device), rows_TF)
        for rid, n in zip(request_ids, counts):
            self.book(rid, n)

    keep_rows: int | None = None
    """Context rows a request keeps (None: all; a ring pool: its window); `placement` drops older ones."""

    def placement(
        self, slots_N: torch.Tensor, counts_N: torch.Tensor, rows: int, *, triton: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_T, position_T) int64 of `rows` packed context rows: request i's counts_N[i] rows
        follow each other at positions length .. of slots_N[i]; rows past sum(counts_N) (a graph's
        padding) and rows older than `keep_rows` of their request go to the pad slot's position 0
        (never read as context). On the device, from the device lengths: no host sync. `triton`:
        in one launch (`step_ops.placement`, the rank's Triton step ops) instead of the torch chain."""
        if triton:
            return step_ops.placement(slots_N, counts_N, self.lengths, rows, self.pad_slot, self.keep_rows)
        device = slots_N.device
        ends_N = counts_N.cumsum(0)
        t_T = torch.arange(rows, device=device)
        req_T = torch.searchsorted(ends_N, t_T, right=True).clamp_(max=max(slots_N.shape[0] - 1, 0))
        j_T = t_T - (ends_N - counts_N)[req_T]
        live_T = t_T < ends_N[-1:]
        if self.keep_rows is not None:
            live_T &= j_T >= counts_N[req_T] - self.keep_rows
        slot_T = slots_N[req_T]
        position_T = self.lengths[slot_T].long() + j_T
        pad = torch.full_like(slot_T, self.pad_slot)
        return torch.where(live_T, slot_T, pad), torch.where(live_T, position_T, 0)

    def advance(self, slots_N: torch.Tensor, counts_N: torch.Tensor) -> None:
        """Advance the device lengths of slots_N by counts_N (the pad slot's counts are 0); no host sync."""
        self.lengths.index_add_(0, slots_N, counts_N.to(self.lengths.dtype))

    def _set_length(self, slot: int, length: int) -> None:
        self._host_lengths[slot] = length
        self.lengths[slot].fill_(length)  # a fill launch; `lengths[slot] = length` copies a CPU scalar and waits

    def _set_sampling(self, slot: int, params: SamplingParams) -> None:
        self._params[slot] = params
        row = SamplingBatch.of([params])
        for name in ("temperature", "top_k", "top_p", "seed"):
            # a fill launch: item assignment (of a Python number or a CPU tensor) copies and waits for the device
            getattr(self._sampling, name)[slot].fill_(getattr(row, name)[0].item())

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every row tensor the pool holds (each pool kind lists its own)."""
        raise NotImplementedError

    @property
    def num_bytes(self) -> int:
        """Bytes the pool's rows hold on its device."""
        return sum(t.numel() * t.element_size() for t in self.buffers)

    @property
    def bytes_per_position(self) -> int:
        """Bytes one context position of one request takes over all layers (what a commit writes per row)."""
        raise NotImplementedError

    def sampling_of(self, slots_N: torch.Tensor, readout: Readout) -> SamplingBatch:
        """The sampling rows of `slots_N` (device, no host sync), with the `readout` the caller
        knows they need (`readout(request_ids)`)."""
        t = self._sampling
        return SamplingBatch(t.temperature[slots_N], t.top_k[slots_N], t.top_p[slots_N], t.seed[slots_N], readout)


class KVPool(RequestSlots):
    """Fixed-size context K/V of up to `max_requests` requests of `max_context` rows each: per layer
    k, v [P, g, C, D] (`RequestSlots` for the limits and the bookkeeping).

    Args:
        num_layers, num_kv_heads, head_dim: the draft's attention shape.
        block_size: B, the rows each step's block adds after the context.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_requests: int,
        max_context: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(max_requests=max_requests, max_context=max_context, block_size=block_size, dtype=dtype,
                         device=device)  # fmt: skip
        shape = (max_requests + 1, num_kv_heads, max_context + block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every row tensor the pool holds (K and V of every layer)."""
        return [*self.k, *self.v]

    @property
    def bytes_per_position(self) -> int:
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in self.buffers)

    def store(self, layer: int, slot_T: torch.Tensor, position_T: torch.Tensor, k_TgD: torch.Tensor,
              v_TgD: torch.Tensor) -> None:  # fmt: skip
        """One layer's K/V of T rows at (slot, position) (`placement`'s), in place."""
        self.k[layer][slot_T, :, position_T] = k_TgD.to(self.dtype)
        self.v[layer][slot_T, :, position_T] = v_TgD.to(self.dtype)


class WindowKVPool(RequestSlots):
    """A pool of one K=V row per position per layer, keeping each request's last `window` rows only
    (DeepSeek DSpark drafts: a block sees the `window` context rows before its anchor and nothing
    older, so older rows are dead): per layer kv [P, window, D], position p in ring row p mod window.
    Bytes per request are independent of max_context; max_context still bounds a request's length.
    Each row carries its own rotation, so a reader needs the ring's valid rows, not their order.
    """

    def __init__(
        self,
        num_layers: int,
        head_dim: int,
        *,
        window: int,
        max_requests: int,
        max_context: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(max_requests=max_requests, max_context=max_context, block_size=block_size, dtype=dtype,
                         device=device)  # fmt: skip
        self.window = window
        self.kv = [torch.zeros(max_requests + 1, window, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every row tensor the pool holds (the K=V ring of every layer)."""
        return list(self.kv)

    @property
    def bytes_per_position(self) -> int:
        return sum(t.shape[2] * t.element_size() for t in self.kv)

    @property
    def keep_rows(self) -> int:
        """A request's last `window` rows: `placement` sends older ones to the pad slot, so no two
        rows of one program land on the same ring row."""
        return self.window

    def store(self, layer: int, slot_T: torch.Tensor, position_T: torch.Tensor, kv_TD: torch.Tensor) -> None:
        """One layer's K=V rows of T positions (`placement`'s) into their rings, in place."""
        self.kv[layer][slot_T, position_T % self.window] = kv_TD.to(self.dtype)

    def window_of(self, layer: int, slots_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_NWD [N, window, D], valid_NW [N, window] bool) of the requests' rings: ring row j is
        valid once written (j < length); on the device, no host sync."""
        valid_NW = torch.arange(self.window, device=slots_N.device) < self.lengths[slots_N].unsqueeze(1)
        return self.kv[layer][slots_N], valid_NW
