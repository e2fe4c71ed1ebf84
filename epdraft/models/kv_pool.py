"""KVPool: the draft's context K/V of every request of a rank, preallocated once, written in place.

Per layer k, v [P, g, C, D]: P = max_requests slots plus one pad slot (the rows a CUDA-graph
bucket pads with attend to it), C = max_context + block_size rows. A request owns one slot for
its lifetime; its committed context rows [0, length) are appended by `extend`, and each draft
step writes its block's K/V to rows [length, length + B), where the next commit overwrites them
(only verified rows ever count as context). Nothing is copied per step and nothing already
admitted is ever moved, evicted or overwritten by another request.
"""

from __future__ import annotations

import torch

from epdraft.errors import RequestError


class KVPool:
    """Fixed-size context K/V of up to `max_requests` requests of `max_context` rows each.

    Args:
        num_layers, num_kv_heads, head_dim: the draft's attention shape.
        max_requests / max_context: the limits (`draft.max_requests`, `draft.max_context`); a
            request beyond either is refused with a RequestError naming the key.
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
        if max_requests < 1 or max_context < 1:
            raise RequestError(
                f"KV pool: draft.max_requests = {max_requests} and draft.max_context = {max_context} must be >= 1"
            )
        self.max_requests, self.max_context, self.block_size = max_requests, max_context, block_size
        self.pad_slot = max_requests
        shape = (max_requests + 1, num_kv_heads, max_context + block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_requests + 1, dtype=torch.int32, device=device)
        self._host_lengths = [0] * (max_requests + 1)
        self._slots: dict[int, int] = {}
        self._free = list(range(max_requests - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_bytes(self) -> int:
        """Bytes the pool holds on its device (K and V of every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

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

    def admit(self, request_id: int) -> int:
        """Give a new request an empty slot; RequestError naming draft.max_requests when none is free."""
        if request_id in self._slots:
            raise RequestError(f"request {request_id} is already active on this rank")
        if not self._free:
            raise RequestError(
                f"request {request_id}: the KV pool is full, {self.max_requests} requests active "
                f"(draft.max_requests = {self.max_requests})"
            )
        slot = self._free.pop()
        self._slots[request_id] = slot
        self._set_length(slot, 0)
        return slot

    def release(self, request_id: int) -> None:
        """Return a finished request's slot (its rows are simply overwritten by the next owner)."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._set_length(slot, 0)
            self._free.append(slot)

    def check_room(self, request_id: int, rows: int) -> None:
        """RequestError naming draft.max_context when `rows` more context rows do not fit the request."""
        length = self.length(request_id)
        if length + rows > self.max_context:
            raise RequestError(
                f"request {request_id}: {length} + {rows} context rows exceed draft.max_context = {self.max_context}"
            )

    def write(self, layer: int, slot: int, start: int, k_gLD: torch.Tensor, v_gLD: torch.Tensor) -> None:
        """Rows [start, start + L) of one slot's layer (context rows, by `extend`)."""
        end = start + k_gLD.shape[1]
        self.k[layer][slot, :, start:end] = k_gLD
        self.v[layer][slot, :, start:end] = v_gLD

    def commit(self, request_id: int, rows: int) -> None:
        """Advance a request's length once every layer has its `rows` new context rows."""
        slot = self.slot(request_id)
        self._set_length(slot, self._host_lengths[slot] + rows)

    def _set_length(self, slot: int, length: int) -> None:
        self._host_lengths[slot] = length
        self.lengths[slot] = length
