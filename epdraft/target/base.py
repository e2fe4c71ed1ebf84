"""The target side of speculative decoding: what the draft runtime needs from any target engine.

A target owns each request's exact KV cache. Per step it verifies one block per request,
[anchor, d_1 .. d_{B-1}] at positions start .. start+B-1, keeps the longest prefix of drafts that
equals its own greedy predictions, and returns the bonus token (its prediction after that prefix,
the next anchor) and the features of the committed rows (anchor + accepted drafts) that the draft
appends to its context. The bonus row's features come with the next verify. A sampled request
keeps the longest prefix the speculative-sampling walk accepts, and its bonus is sampled
(`epdraft.sampling`): its tokens are distributed as the target's own sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import RequestError
from epdraft.sampling.rejection import greedy_accept

__all__ = ["PrefillResult", "Target", "VerifyResult", "greedy_accept", "validate_prompt"]


def _segments(lens: torch.Tensor) -> list[slice]:
    """Consecutive row slices of the given lengths, from one host copy of them (no per-request sync)."""
    bounds = [0, *itertools.accumulate(lens.tolist())]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """Prefill of N requests.

    first_tokens: [N] int64, the target's greedy token after each prompt (the first anchor).
    prompt_lens: [N] int64.
    features: [sum(prompt_lens), K*H] target features of every prompt row, requests in order.
    """

    request_ids: tuple[int, ...]
    first_tokens: torch.Tensor
    prompt_lens: torch.Tensor
    features: torch.Tensor

    @functools.cached_property
    def _slices(self) -> list[slice]:
        return _segments(self.prompt_lens)

    def rows(self, i: int) -> slice:
        """The rows of `features` belonging to request i."""
        return self._slices[i]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Verify of N blocks (one per request).

    accept_lens: [N] int64, accepted drafts per request, 0 .. B-1 (NOT counting the bonus token).
    bonus: [N] int64, the target's token after the accepted prefix: the next anchor.
    commit_lens: [N] int64 = accept_lens + 1, rows committed to the target KV (anchor + accepted).
    committed_ids: [sum(commit_lens)] int64, tokens of the committed rows (each request's anchor first).
    features: [sum(commit_lens), K*H] target features of the committed rows.
    tested: [N] int64, the accept tests that ran (the accepted drafts and the first rejected one),
        or None when the target does not say.
    expected_accepts: [N] fp32, sum over those tests of sum_x min(p, q): the accepts the draft could
        expect there (equal in expectation to accept_lens under sampling), or None.
    """

    request_ids: tuple[int, ...]
    accept_lens: torch.Tensor
    bonus: torch.Tensor
    commit_lens: torch.Tensor
    committed_ids: torch.Tensor
    features: torch.Tensor
    tested: torch.Tensor | None = None
    expected_accepts: torch.Tensor | None = None

    @functools.cached_property
    def _slices(self) -> list[slice]:
        return _segments(self.commit_lens)

    @functools.cached_property
    def _host_tokens(self) -> tuple[list[int], list[int]]:
        """committed_ids and bonus as host lists, copied once for every request's `emitted`."""
        return self.committed_ids.tolist(), self.bonus.tolist()

    def rows(self, i: int) -> slice:
        """The rows of `committed_ids` / `features` belonging to request i."""
        return self._slices[i]

    def emitted(self, i: int) -> list[int]:
        """New output tokens of request i this step: its accepted drafts, then the bonus token."""
        committed, bonus = self._host_tokens
        return committed[self.rows(i)][1:] + [bonus[i]]


@runtime_checkable
class Target(Protocol):
    """A target model serving the requests of one DP rank (state per request id)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    feature_layer_ids: tuple[int, ...]

    def prefill(
        self,
        request_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> PrefillResult:
        """Run each prompt, keep its KV cache and sampling (None: every request greedy); the first
        token is the argmax, or sampled. Raises RequestError for an empty or out-of-vocab prompt."""
        ...

    def verify(
        self, request_ids: Sequence[int], blocks_NB: torch.Tensor, draft_probs_NKV: torch.Tensor | None = None
    ) -> VerifyResult:
        """Verify one block [anchor, drafts...] per request: the greedy rule for an all-greedy batch,
        else speculative sampling against the draft's proposal probabilities `draft_probs_NKV`
        [N, K, V] (`epdraft.sampling.speculative_accept`); KV cropped to the committed rows."""
        ...

    def release(self, request_id: int) -> None:
        """Drop a finished request's state."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., H] of ids [...]."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of hidden [..., H]."""
        ...


def validate_prompt(request_id: int, prompt: Sequence[int], vocab_size: int) -> None:
    """Raise RequestError naming the request if its prompt is empty or has ids outside [0, vocab_size)."""
    if len(prompt) == 0:
        raise RequestError(f"request {request_id}: empty prompt")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"request {request_id}: token id {bad[0]!r} outside the vocabulary [0, {vocab_size}) "
            f"({len(bad)} bad id(s))"
        )
