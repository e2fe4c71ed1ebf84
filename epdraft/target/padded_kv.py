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

# One request's committed KV: per decoder layer (keys, values), each [kv_heads, L, head_dim].
RequestKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """The forward inputs of one batched step over N requests with a block of B tokens each.

    cache: an HF `DynamicCache` of N rows, each request's KV right-aligned to `width` columns.
    attention_mask: [N, width + B] int64, 0 on each request's pad columns.
    position_ids: [N, B] int64, each request's true positions (its length onwards).
    pads: pad columns per request, `width - len`.
    """

    cache: object
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    pads: tuple[int, ...]
    width: int


def kv_of_single(cache) -> RequestKV:
    """The KV of a one-request `DynamicCache` (batch row 0 of every layer)."""
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def seq_len(kv: RequestKV) -> int:
    """Committed rows held in a request's KV."""
    return int(kv[0][0].shape[-2])


def stack_left_padded(kvs: Sequence[RequestKV], block_len: int, config) -> PaddedBatch:
    """Stack N requests' KV into one left-padded `DynamicCache` for a forward of `block_len` tokens each."""
    from transformers import DynamicCache

    lens = [seq_len(kv) for kv in kvs]
    width = max(lens)
    pads = tuple(width - n for n in lens)
    N, device = len(kvs), kvs[0][0][0].device
    cache = DynamicCache(config=config)
    for layer_idx in range(len(kvs[0])):
        k0, v0 = kvs[0][layer_idx]
        keys = k0.new_zeros(N, k0.shape[0], width, k0.shape[-1])
        values = v0.new_zeros(N, v0.shape[0], width, v0.shape[-1])
        for i, kv in enumerate(kvs):
            keys[i, :, pads[i]:] = kv[layer_idx][0]
            values[i, :, pads[i]:] = kv[layer_idx][1]
        cache.update(keys, values, layer_idx)
    cols = torch.arange(width + block_len, device=device)
    pads_t = torch.tensor(pads, device=device)
    attention_mask = (cols.unsqueeze(0) >= pads_t.unsqueeze(1)).to(torch.long)
    position_ids = torch.tensor(lens, device=device).unsqueeze(1) + torch.arange(block_len, device=device)
    return PaddedBatch(cache=cache, attention_mask=attention_mask, position_ids=position_ids, pads=pads, width=width)


def split_committed(batch: PaddedBatch, commit_lens: Sequence[int]) -> list[RequestKV]:
    """Each request's KV after the forward: its own rows plus the first `commit_lens[i]` block rows.

    The rest of the block (the rejected drafts) and the pad columns are left behind, so the next
    step sees exactly the KV a plain greedy decode would have built.
    """
    out: list[RequestKV] = []
    for i, n in enumerate(commit_lens):
        stop = batch.width + int(n)
        out.append([(layer.keys[i, :, batch.pads[i]:stop], layer.values[i, :, batch.pads[i]:stop])
                    for layer in batch.cache.layers])
    return out
