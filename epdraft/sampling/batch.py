"""SamplingBatch: N requests' sampling parameters as device tensors, one row per request.

Both sides of a speculative step read them per row: the draft samples its proposals with them, the
target processes its verify logits with them. A request with no seed of its own gets one derived
from a base seed and its index (`request_seed`), so its tokens still depend only on what it is,
never on the batch or rank it lands in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.sampling.counter_rng import Stream, uniforms


def request_seed(base_seed: int, index: int) -> int:
    """A 53-bit seed for request `index` of a run seeded `base_seed` (a request without `seed`):
    a counter-based hash, so distinct requests draw independent streams."""
    u = uniforms(torch.tensor(base_seed), torch.tensor(index), Stream.SEED)
    return int(u.item() * 2.0**53)


def seeded(params: SamplingParams, base_seed: int, index: int) -> SamplingParams:
    """`params` with its own seed, or `request_seed(base_seed, index)` when it has none."""
    if params.seed is not None:
        return params
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          seed=request_seed(base_seed, index))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """temperature [N] fp32 (0 = greedy), top_k [N] int64 (0 = none), top_p [N] fp32 (1 = none),
    seed [N] int64; greedy: whether every row is greedy (known on the host, so a caller can take
    the argmax path without reading the device)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    greedy: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        """One row per request. A sampled request must carry its seed (`seeded`): ValueError otherwise."""
        unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if unseeded:
            raise ValueError(f"sampled request at row {unseeded[0]} has no seed: resolve it with `seeded` first")
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], **f32),
            top_k=torch.tensor([p.top_k or 0 for p in params], **i64),
            top_p=torch.tensor([p.top_p for p in params], **f32),
            seed=torch.tensor([p.seed or 0 for p in params], **i64),
            greedy=all(p.greedy for p in params),
        )
