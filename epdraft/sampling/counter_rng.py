"""Counter-based uniform random numbers: u = hash(seed, position, stream), no generator state.

A request's random numbers depend only on its seed and the token position they decide (and which
decision, `Stream`), never on the batch around it, its rank, the layout or whether the step was
replayed from a CUDA graph: the same seed gives the same tokens everywhere. Each number comes from
two rounds of murmur3's 32-bit finalizer over the key words, combined into 53 bits (float64 in
[0, 1)). The arithmetic stays below 2**49 in int64 (32-bit products split in 16-bit halves), so
it is exact and identical on every device.
"""

from __future__ import annotations

import enum

import torch

_MASK32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """Which decision at a position a number is for (each its own independent stream)."""

    DRAFT = 1  # the draft's token sampled from q at this position
    ACCEPT = 2  # the target's accept test of the draft token at this position
    TARGET = 3  # the target's own token at this position: a rejection's residual, or the bonus
    SEED = 4  # a request's own seed, derived from a run seed and its index (`request_seed`)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h < 2**32, without an int64 product past 2**49."""
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection with full avalanche) on int64 holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(words: list[torch.Tensor], salt: int) -> torch.Tensor:
    h = torch.full_like(words[0], salt)
    for w in words:
        h = _fmix32(h ^ w)
    return h


def uniforms(seed: torch.Tensor, position: torch.Tensor, stream: Stream) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per element of the broadcast of `seed` and `position`
    (int64, seed in [0, 2**63), position >= 0), for decision `stream`."""
    seed, position = torch.broadcast_tensors(seed.long(), position.long())
    words = [seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32,
             torch.full_like(seed, int(stream))]  # fmt: skip
    a = _hash(words, 0x9E3779B9) >> 6  # 26 bits
    b = _hash(words, 0x7F4A7C15) >> 5  # 27 bits
    return (a * (1 << 27) + b).double() * 2.0**-53
