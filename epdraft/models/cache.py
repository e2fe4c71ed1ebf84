"""The draft's per-request KV cache: context K/V only (block K/V are recomputed every step).

Context rows only ever grow (one verify's committed rows at a time), so each layer keeps a
preallocated [g, capacity, D] buffer that doubles when full: a generation of L rows copies O(L)
rows in total and reallocates O(log L) times, where a `torch.cat` per append would copy O(L^2).
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64
"""Rows a layer's buffer starts with (or the first append's rows, if more)."""


class DraftCache:
    """Context K/V of one request, per draft layer: k, v [g, L, D] with L = `length` committed rows.

    Context row p holds the target features of the token at position p, so `length` is also the
    position of the next anchor. Grows by the committed rows after each verify; never cropped,
    since only committed (verified) rows ever enter it. `allocations` counts buffer (re)allocations
    over all layers, so growth cost is observable.
    """

    def __init__(self, num_layers: int):
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._filled = [0] * num_layers
        self.length = 0
        self.allocations = 0

    def capacity(self, layer: int) -> int:
        """Rows the layer's buffer holds before it must grow."""
        buf = self._keys[layer]
        return 0 if buf is None else buf.shape[1]

    def append(self, layer: int, k_gLD: torch.Tensor, v_gLD: torch.Tensor) -> None:
        """Append rows to one layer; the caller advances `length` once all layers are written."""
        start = self._filled[layer]
        end = start + k_gLD.shape[1]
        if end > self.capacity(layer):
            self._grow(layer, k_gLD, end)
        self._keys[layer][:, start:end] = k_gLD
        self._values[layer][:, start:end] = v_gLD
        self._filled[layer] = end

    def _grow(self, layer: int, like_gLD: torch.Tensor, needed: int) -> None:
        """Move the layer to a buffer of max(needed, 2 * capacity, MIN_CAPACITY) rows."""
        g, _, D = like_gLD.shape
        rows = max(needed, 2 * self.capacity(layer), MIN_CAPACITY)
        filled = self._filled[layer]
        for bufs in (self._keys, self._values):
            new = like_gLD.new_empty(g, rows, D)
            if bufs[layer] is not None:
                new[:, :filled] = bufs[layer][:, :filled]
            bufs[layer] = new
        self.allocations += 1

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views k, v [g, length, D] of one layer's committed rows; None before the first append."""
        k, v = self._keys[layer], self._values[layer]
        if k is None or v is None:
            return None
        return k[:, : self.length], v[:, : self.length]


class ContextScratch:
    """A reused [N, g, Lmax, D] K/V pair that `padded_context` copies N requests' context into,
    so a step allocates it once for all its layers instead of once per layer."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def get(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._k
        if k is None or tuple(k.shape) != shape or k.dtype != like.dtype or k.device != like.device:
            self._k, self._v = like.new_zeros(shape), like.new_zeros(shape)
        return self._k, self._v


def padded_context(
    caches: list[DraftCache],
    layer: int,
    like: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    scratch: ContextScratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's context K/V of N requests, right-padded with zeros to the longest: [N, g, Lmax, D].

    One request: views of its cache (no copy). Several: a copy into `scratch` (the result is then
    overwritten by the next call with it) or into a fresh zeroed pair without one.
    """
    if len(caches) == 1 and caches[0].length:
        k, v = caches[0].kv(layer)
        return k.unsqueeze(0).to(like.dtype), v.unsqueeze(0).to(like.dtype)
    longest = max((c.length for c in caches), default=0)
    shape = (len(caches), num_kv_heads, longest, head_dim)
    if scratch is None:
        k, v = like.new_zeros(shape), like.new_zeros(shape)
    else:
        k, v = scratch.get(shape, like)
    for i, c in enumerate(caches):
        if c.length:
            ck, cv = c.kv(layer)
            k[i, :, : c.length] = ck
            v[i, :, : c.length] = cv
        if scratch is not None and c.length < longest:
            k[i, :, c.length :] = 0
            v[i, :, c.length :] = 0
    return k, v


def context_mask(caches: list[DraftCache], block_size: int, device: torch.device) -> torch.Tensor:
    """allowed [N, B, Lmax + B]: each block row sees its own valid context rows and the whole block."""
    longest = max((c.length for c in caches), default=0)
    lengths = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
    ctx_ok = torch.arange(longest, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    blk_ok = torch.ones(len(caches), block_size, dtype=torch.bool, device=device)
    return torch.cat([ctx_ok, blk_ok], dim=1).unsqueeze(1).expand(-1, block_size, -1)
