"""The draft's per-request KV cache: context K/V only (block K/V are recomputed every step)."""

from __future__ import annotations

import torch


class DraftCache:
    """Context K/V of one request, per draft layer: k, v [g, L, D] with L = `length` committed rows.

    Context row p holds the target features of the token at position p, so `length` is also the
    position of the next anchor. Grows by the committed rows after each verify; never cropped,
    since only committed (verified) rows ever enter it.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k_gLD: torch.Tensor, v_gLD: torch.Tensor) -> None:
        """Append rows to one layer; the caller advances `length` once all layers are written."""
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k_gLD if old_k is None else torch.cat([old_k, k_gLD], dim=1)
        self.values[layer] = v_gLD if old_v is None else torch.cat([old_v, v_gLD], dim=1)


def padded_context(
    caches: list[DraftCache], layer: int, like: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's context K/V of N requests, right-padded with zeros to the longest: [N, g, Lmax, D]."""
    longest = max((c.length for c in caches), default=0)
    k = like.new_zeros(len(caches), num_kv_heads, longest, head_dim)
    v = like.new_zeros(len(caches), num_kv_heads, longest, head_dim)
    for i, c in enumerate(caches):
        if c.length:
            k[i, :, : c.length] = c.keys[layer]
            v[i, :, : c.length] = c.values[layer]
    return k, v


def context_mask(caches: list[DraftCache], block_size: int, device: torch.device) -> torch.Tensor:
    """allowed [N, B, Lmax + B]: each block row sees its own valid context rows and the whole block."""
    longest = max((c.length for c in caches), default=0)
    lengths = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
    ctx_ok = torch.arange(longest, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    blk_ok = torch.ones(len(caches), block_size, dtype=torch.bool, device=device)
    return torch.cat([ctx_ok, blk_ok], dim=1).unsqueeze(1).expand(-1, block_size, -1)
