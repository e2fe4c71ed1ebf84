"""Left-padded batching of per-request KV caches, so one forward verifies every request of a rank.

Each request keeps its own committed K/V rows. A verify step stacks them into one batch
right-aligned (left-padded), so every request's block lands in the same columns; the pad columns
are masked out and each row gets its true positions, so a request attends to exactly what a
forward of its own would. Afterwards each request keeps its own rows up to what it committed.
Re-stacking copies the KV once per step (O(total KV)), which costs far less than one forward per
request; it also makes a request joining or finishing free, as there is no shared layout to repack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class RequestKV:
    """One request's committed KV: `length` rows, and per decoder layer (keys, values), each
    [kv_heads, rows, head_dim]: every row on a full-attention layer, the last min(length, W-1)
    on a sliding layer of window W (all a later query can see, as transformers keeps them)."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """The forward inputs of one batched step over N requests with a block of B tokens each.

    cache: an HF `DynamicCache` of N rows, each request's KV right-aligned to `width` columns
        (a sliding layer holds only the last min(width, W-1) of those columns).
    attention_mask: [N, width + B] int64, 0 on each request's pad columns.
    position_ids: [N, B] int64, each request's true positions (its length onwards).
    pads: pad columns per request, `width - len`. lens: each request's committed rows.
    windows: per layer, the sliding window W or None (full attention).
    """

    cache: object
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    pads: tuple[int, ...]
    lens: tuple[int, ...]
    width: int
    windows: tuple[int | None, ...]


def _window(layer) -> int | None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, the sliding window transformers' cache keeps for it (None: the whole past)."""
    from transformers import DynamicCache

    return tuple(_window(layer) for layer in DynamicCache(config=config).layers)


def kv_of_single(cache, length: int) -> RequestKV:
    """The KV of a one-request `DynamicCache` holding `length` tokens (batch row 0 of every layer)."""
    return RequestKV(length, [(layer.keys[0], layer.values[0]) for layer in cache.layers])


def seq_len(kv: RequestKV) -> int:
    """Committed rows of a request."""
    return kv.length


def stack_left_padded(kvs: Sequence[RequestKV], block_len: int, config) -> PaddedBatch:
    """Stack N requests' KV into one left-padded `DynamicCache` for a forward of `block_len` tokens each.

    A full layer gets `width` columns; a sliding layer of window W only the last s = min(width, W-1),
    which hold each request's last min(len, s) rows: the KV copied per step is O(W) on it, not O(L).
    Its `cumulative_length` is set to `width`, so transformers places the mask's key offset and the
    window (kv > q - W, in padded columns: every request is right-aligned, so column distance is
    position distance) exactly as over `width` columns; past recording keeps the block's rows until
    `split_committed` has picked each request's committed ones.
    """
    from transformers import DynamicCache

    lens = [kv.length for kv in kvs]
    width = max(lens)
    pads = tuple(width - n for n in lens)
    N, device = len(kvs), kvs[0].layers[0][0].device
    cache = DynamicCache(config=config)
    windows = tuple(_window(layer) for layer in cache.layers)
    for layer_idx, window in enumerate(windows):
        k0, v0 = kvs[0].layers[layer_idx]
        cols = width if window is None else min(width, window - 1)
        keys = k0.new_zeros(N, k0.shape[0], cols, k0.shape[-1])
        values = v0.new_zeros(N, v0.shape[0], cols, v0.shape[-1])
        for i, kv in enumerate(kvs):
            m = min(lens[i], cols)
            if m:
                k, v = kv.layers[layer_idx]
                keys[i, :, cols - m:] = k[:, k.shape[1] - m:]
                values[i, :, cols - m:] = v[:, v.shape[1] - m:]
        layer = cache.layers[layer_idx]
        if window is not None:
            layer.activate_past_recording()
        cache.update(keys, values, layer_idx)
        if window is not None:
            layer.cumulative_length = width
    cols = torch.arange(width + block_len, device=device)
    pads_t = torch.tensor(pads, device=device)
    attention_mask = (cols.unsqueeze(0) >= pads_t.unsqueeze(1)).to(torch.long)
    position_ids = torch.tensor(lens, device=device).unsqueeze(1) + torch.arange(block_len, device=device)
    return PaddedBatch(cache=cache, attention_mask=attention_mask, position_ids=position_ids, pads=pads,
                       lens=tuple(lens), width=width, windows=windows)


def split_committed(batch: PaddedBatch, commit_lens: Sequence[int]) -> list[RequestKV]:
    """Each request's KV after the forward: its own rows plus the first `commit_lens[i]` block rows
    (on a sliding layer, the last W-1 of those).

    The rest of the block (the rejected drafts) and the pad columns are left behind, so the next
    step sees exactly the KV a plain greedy decode would have built.
    """
    out: list[RequestKV] = []
    for i, n in enumerate(commit_lens):
        length = batch.lens[i] + int(n)
        layers = []
        for layer, window in zip(batch.cache.layers, batch.windows):
            # Column c of this layer's keys is padded column width + B - cols + c: the request's
            # committed rows end at padded column width + n.
            cols = layer.keys.shape[2]
            end = cols - (batch.attention_mask.shape[1] - batch.width - int(n))
            rows = length if window is None else min(length, window - 1)
            layers.append((layer.keys[i, :, end - rows:end], layer.values[i, :, end - rows:end]))
        out.append(RequestKV(length, layers))
    return out
