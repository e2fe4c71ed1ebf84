"""The per-request KV cache of the step's oracle (`epdraft.models.reference`): context K/V only
(block K/V are recomputed every step). The runtime keeps context in a KV pool (`kv_pool.py`).

Context rows only ever grow (one verify's committed rows at a time), so each layer keeps a
preallocated [g, capacity, D] buffer that doubles when full: a generation of L rows copies O(L)
rows in total and reallocates O(log L) times, where a `torch.cat` per append would copy O(L^2).

A sliding-window layer of window W only ever reads the last W-1 context rows again (the block's
first query, at the anchor's position p, sees keys > p - W), so its buffer is capped near 2(W-1)
rows: when full, the last W-1 rows move to the front. It holds O(W) rows whatever L.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epdraft.errors import ConfigError

MIN_CAPACITY = 64
"""Rows a layer's buffer starts with (or the first append's rows, if more)."""


class DraftCache:
    """Context K/V of one request, per draft layer: k, v [g, L, D] with L = `length` committed rows
    (the last min(L, W-1) of them for a layer of sliding window W).

    Context row p holds the target features of the token at position p, so `length` is also the
    position of the next anchor. Grows by the committed rows after each verify; never cropped,
    since only committed (verified) rows ever enter it. `allocations` counts buffer (re)allocations
    over all layers, so growth cost is observable.
    """

    def __init__(self, num_layers: int, windows: Sequence[int | None] | None = None):
        windows = list(windows) if windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ConfigError(f"DraftCache: {len(windows)} windows for {num_layers} layers")
        self._keep = [None if w is None else w - 1 for w in windows]
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._filled = [0] * num_layers
        self._first = [0] * num_layers  # position of buffer row 0
        self.length = 0
        self.allocations = 0

    def capacity(self, layer: int) -> int:
        """Rows the layer's buffer holds before it must grow."""
        buf = self._keys[layer]
        return 0 if buf is None else buf.shape[1]

    def rows(self, layer: int) -> int:
        """Context rows `kv(layer)` returns: `length`, or the last W-1 of them on a sliding layer."""
        keep = self._keep[layer]
        return self.length if keep is None else min(self.length, keep)

    def append(self, layer: int, k_gLD: torch.Tensor, v_gLD: torch.Tensor) -> None:
        """Append rows to one layer; the caller advances `length` once all layers are written."""
        keep = self._keep[layer]
        start = self._filled[layer]
        end = start + k_gLD.shape[1]
        if keep is not None and end > self.capacity(layer):
            self._slide(layer, k_gLD, v_gLD, keep)
            return
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

    def _slide(self, layer: int, k_gLD: torch.Tensor, v_gLD: torch.Tensor, keep: int) -> None:
        """Sliding layer full: keep only the last `keep` rows of (buffer ++ new rows), at the buffer's front."""
        filled, n = self._filled[layer], k_gLD.shape[1]
        if keep == 0:  # window 1: a query sees no context at all
            self._first[layer] += n
            return
        new = min(n, keep)
        old = min(filled, keep - new)
        if self.capacity(layer) < keep:
            g, _, D = k_gLD.shape
            for bufs in (self._keys, self._values):
                buf = k_gLD.new_empty(g, max(2 * keep, MIN_CAPACITY), D)
                if bufs[layer] is not None and old:
                    buf[:, :old] = bufs[layer][:, filled - old : filled]
                bufs[layer] = buf
            self.allocations += 1
        elif old:
            for bufs in (self._keys, self._values):
                bufs[layer][:, :old] = bufs[layer][:, filled - old : filled].clone()  # may overlap
        self._keys[layer][:, old : old + new] = k_gLD[:, n - new :]
        self._values[layer][:, old : old + new] = v_gLD[:, n - new :]
        self._first[layer] += filled + n - (old + new)
        self._filled[layer] = old + new

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views k, v [g, rows(layer), D] of the layer's last committed rows; None when it holds none."""
        k, v = self._keys[layer], self._values[layer]
        rows = self.rows(layer)
        if k is None or v is None or rows == 0:
            return None
        stop = self.length - self._first[layer]
        return k[:, stop - rows : stop], v[:, stop - rows : stop]


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

    Row counts are each cache's `rows(layer)` (the last W-1 rows on a sliding layer). One request:
    views of its cache (no copy). Several: a copy into `scratch` (the result is then overwritten by
    the next call with it) or into a fresh zeroed pair without one.
    """
    rows = [c.rows(layer) for c in caches]
    if len(caches) == 1 and rows[0]:
        k, v = caches[0].kv(layer)
        return k.unsqueeze(0).to(like.dtype), v.unsqueeze(0).to(like.dtype)
    longest = max(rows, default=0)
    shape = (len(caches), num_kv_heads, longest, head_dim)
    if scratch is None:
        k, v = like.new_zeros(shape), like.new_zeros(shape)
    else:
        k, v = scratch.get(shape, like)
    for i, (c, n) in enumerate(zip(caches, rows)):
        if n:
            ck, cv = c.kv(layer)
            k[i, :, :n] = ck
            v[i, :, :n] = cv
        if scratch is not None and n < longest:
            k[i, :, n:] = 0
            v[i, :, n:] = 0
    return k, v


def context_mask(
    caches: list[DraftCache], block_size: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """allowed [N, B, Lmax + B] for the layout of `padded_context`.

    Full layer (window None): each block row sees its request's whole context and the whole block.
    Sliding layer (SpecForge's training mask at the block of anchor position a): block row q sees
    context positions p >= a + q - (window - 1), and block rows <= q (causal in-block). Its context
    columns hold the last min(a, window - 1) positions, so column j is position a - rows + j.
    """
    lengths = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
    rows_N = lengths if window is None else lengths.clamp(max=window - 1)
    longest = int(rows_N.max()) if len(caches) else 0
    j = torch.arange(longest, device=device).view(1, 1, -1)
    ctx_ok = (j < rows_N.view(-1, 1, 1)).expand(-1, block_size, -1)
    q = torch.arange(block_size, device=device).view(1, -1, 1)
    if window is None:
        blk_ok = torch.ones(len(caches), block_size, block_size, dtype=torch.bool, device=device)
    else:
        ctx_ok = ctx_ok & (j >= rows_N.view(-1, 1, 1) - (window - 1) + q)
        blk_ok = (torch.arange(block_size, device=device).view(1, 1, -1) <= q).expand(len(caches), -1, -1)
    return torch.cat([ctx_ok, blk_ok], dim=2)
