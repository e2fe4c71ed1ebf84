"""SamplingBatch: N requests' sampling parameters as device tensors, one row per request.

Both sides of a speculative step read them per row: the draft samples its proposals with them, the
target processes its verify logits with them. A request with no seed of its own gets one derived
from a base seed and its index (`request_seed`), so its tokens still depend only on what it is,
never on the batch or rank it lands in.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.sampling.counter_rng import Stream, uniforms
from epdraft.sampling.probabilities import probabilities


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


class Readout(enum.Enum):
    """What a batch's tokens need, known on the host (so a step takes the cheapest path, and a
    CUDA graph is captured per kind): the argmax, a softmax at each row's temperature, or that
    plus top-k / top-p filtering (a sort over the vocabulary)."""

    ARGMAX = "argmax"  # every row greedy
    SAMPLE = "sample"  # some row samples; no row has top-k or top-p
    FILTERED = "filtered"  # some row samples with top-k or top-p

    @classmethod
    def of(cls, params: Iterable[SamplingParams]) -> Readout:
        sampled = [p for p in params if not p.greedy]
        if not sampled:
            return cls.ARGMAX
        return cls.FILTERED if any(p.top_k is not None or p.top_p < 1.0 for p in sampled) else cls.SAMPLE


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """temperature [N] fp32 (0 = greedy), top_k [N] int64 (0 = none), top_p [N] fp32 (1 = none),
    seed [N] int64; readout: what the rows need, known on the host."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    readout: Readout

    @property
    def greedy(self) -> bool:
        """Every row greedy: the argmax rule, no probabilities."""
        return self.readout is Readout.ARGMAX

    def probabilities(self, logits_NkV: torch.Tensor) -> torch.Tensor:
        """Each row's processed probabilities [N, k, V] fp32 of its k positions' logits (its settings
        apply to every position; the top-k / top-p sorts only for a `Readout.FILTERED` batch)."""
        return probabilities(logits_NkV, self.temperature.unsqueeze(1), self.top_k.unsqueeze(1),
                             self.top_p.unsqueeze(1), filtered=self.readout is Readout.FILTERED)  # fmt: skip

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
            readout=Readout.of(params),
        )
