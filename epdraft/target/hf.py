"""HFTarget: a Hugging Face transformers causal LM as the target, replicated on each rank.

Per request it keeps KV that always holds exactly the committed tokens (on a sliding-window layer,
the last W-1 of them, as transformers' own cache does). Verify runs every
request's block in one batched forward on top of its left-padded KV (`padded_kv`), then keeps each
request's committed rows only, so the next step sees the same KV a plain greedy decode would have
built. One forward per step instead of one per request: per-request forwards were about half of a
serving step's time on CPU and GPU alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch

from epdraft.config.sampling import SamplingParams
from epdraft.errors import ConfigError, LoadError, RequestError
from epdraft.sampling import (
    SamplingBatch,
    Stream,
    sample_tokens,
    seeded,
    speculative_accept,
    uniforms,
)
from epdraft.target.base import PrefillResult, VerifyResult, validate_prompt
from epdraft.target.padded_kv import (
    RequestKV,
    kv_of_single,
    layer_windows,
    seq_len,
    split_committed,
    stack_left_padded,
)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache under: `cache` on recent transformers 5.x,
    `past_key_values` on earlier 5.x (5.17 on the GPU image). The wrong one is swallowed by
    `**kwargs`: the model then fills a throw-away cache and ours stays empty."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFTarget:
    """An `AutoModelForCausalLM` serving as `epdraft.target.Target`.

    Feature id j is HF `hidden_states[j + 1]` (the output of decoder layer j; for the last layer HF
    applies the final norm first, as SpecForge's training reads it too).
    """

    def __init__(self, model: torch.nn.Module, feature_layer_ids: Sequence[int]):
        cfg = model.config
        self.model = model.eval()
        self._cache_kw = cache_kwarg(model)
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.feature_layer_ids = tuple(int(j) for j in feature_layer_ids)
        bad = [j for j in self.feature_layer_ids if not 0 <= j < self.num_layers]
        if not self.feature_layer_ids or bad:
            raise ConfigError(
                f"target_layer_ids {list(self.feature_layer_ids)}: need at least one id, each in [0, {self.num_layers})"
            )
        other = [(i, t) for i, t in enumerate(getattr(cfg, "layer_types", None) or [])
                 if t not in ("full_attention", "sliding_attention")]
        if other:
            raise ConfigError(
                f"target layer_types: layer {other[0][0]} is {other[0][1]!r}; only full_attention and "
                "sliding_attention layers are supported"
            )
        window = getattr(cfg, "sliding_window", None)
        sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
        if sliding and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"target sliding_window = {window!r} must be a positive integer")
        # Per layer, the window transformers' own cache keeps (verify keeps the same rows).
        self.layer_windows = layer_windows(cfg)
        self._kv: dict[int, RequestKV] = {}
        self._sampling: dict[int, SamplingParams] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | Path, feature_layer_ids: Sequence[int], *, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> "HFTarget":
        """Load a saved HF model directory; LoadError names the path when it cannot be read.

        Local files only: a mistyped directory must fail as missing, not be fetched as a hub id.
        """
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device)
        except (OSError, ValueError) as e:
            raise LoadError(f"{path}: cannot load the target model: {e}") from e
        return cls(model, feature_layer_ids)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., H] of ids [...] (the draft embeds its block with these)."""
        return self.model.get_input_embeddings()(ids.to(self.device))

    @torch.no_grad()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of hidden [..., H] (the draft reads its drafts out with this)."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    def _features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """Features [..., T, K*H] of HF `hidden_states` (embeddings first, then one per layer)."""
        return torch.cat([hidden_states[j + 1] for j in self.feature_layer_ids], dim=-1)

    @torch.no_grad()
    def prefill(
        self,
        request_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> PrefillResult:
        """Run each prompt into a fresh KV cache: the first token and every prompt row's features.

        sampling: each request's (None: all greedy); kept for its verifies. A sampled request's
        first token is drawn from its processed logits with the TARGET stream at its position (a
        request without a seed of its own draws from one derived from its id, `seeded`).
        Prompts run one at a time: the serving loop admits requests one by one, and unpadded
        prompts need no fully-masked pad queries. Raises RequestError naming the request for an
        empty prompt or an id outside the vocabulary.
        """
        from transformers import DynamicCache

        params = list(sampling) if sampling is not None else [SamplingParams()] * len(request_ids)
        firsts, lens, feats = [], [], []
        for rid, prompt, p in zip(request_ids, prompts, params, strict=True):
            validate_prompt(rid, prompt, self.vocab_size)
            if rid in self._kv:
                raise RequestError(f"request {rid}: already prefilled on this target")
            cache = DynamicCache(config=self.model.config)
            ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
            out = self.model(input_ids=ids, use_cache=True, output_hidden_states=True, **{self._cache_kw: cache})
            self._kv[rid] = kv_of_single(cache, len(prompt))
            self._sampling[rid] = p = seeded(p, 0, rid)
            firsts.append(self._first_token(out.logits[0, -1], p, len(prompt)))
            lens.append(len(prompt))
            feats.append(self._features(out.hidden_states)[0])
        H = self.hidden_size * len(self.feature_layer_ids)
        return PrefillResult(
            request_ids=tuple(request_ids),
            first_tokens=torch.stack(firsts) if firsts else torch.zeros(0, dtype=torch.long),
            prompt_lens=torch.tensor(lens, dtype=torch.long),
            features=torch.cat(feats) if feats else torch.zeros(0, H, device=self.device),
        )

    def _first_token(self, logits_V: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
        """The token at `position` (the prompt's length) after the prompt: argmax, or sampled."""
        if params.greedy:
            return logits_V.argmax()
        row = SamplingBatch.of([params], logits_V.device)
        probs_1V = row.probabilities(logits_V.view(1, 1, -1))[0]
        u = uniforms(row.seed, torch.tensor([position], device=logits_V.device), Stream.TARGET)
        return sample_tokens(probs_1V, u)[0]

    @torch.no_grad()
    def verify(
        self, request_ids: Sequence[int], blocks_NB: torch.Tensor, draft_probs_NKV: torch.Tensor | None = None
    ) -> VerifyResult:
        """Verify one block per request in one batched forward; each KV keeps only the committed rows.

        An all-greedy batch keeps the longest prefix equal to the target's argmax (bit-lossless);
        with sampled requests the speculative-sampling walk decides (`speculative_accept`), against
        `draft_probs_NKV` [N, K, V], the draft's proposal probabilities (RequestError without them).
        """
        N, B = blocks_NB.shape
        H = self.hidden_size * len(self.feature_layer_ids)
        if len(request_ids) != N:
            raise RequestError(f"verify got {len(request_ids)} request ids for {N} blocks")
        if len(set(request_ids)) != N:
            raise RequestError(f"verify got a request id more than once: {list(request_ids)}")
        missing = [rid for rid in request_ids if rid not in self._kv]
        if missing:
            raise RequestError(f"request {missing[0]}: verify before prefill (or after release)")
        if N == 0:
            empty = torch.zeros(0, dtype=torch.long)
            return VerifyResult(request_ids=(), accept_lens=empty, bonus=empty, commit_lens=empty,
                                committed_ids=empty, features=torch.zeros(0, H, device=self.device))
        batch = SamplingBatch.of([self._sampling[rid] for rid in request_ids], self.device)
        if not batch.greedy and draft_probs_NKV is None:
            sampled = next(rid for rid in request_ids if not self._sampling[rid].greedy)
            raise RequestError(f"request {sampled} samples: verify needs the draft's proposal probabilities")
        blocks_NB = blocks_NB.to(self.device)
        kvs = [self._kv[rid] for rid in request_ids]
        start_N = torch.tensor([seq_len(kv) for kv in kvs], dtype=torch.long, device=self.device)
        batch_kv = stack_left_padded(kvs, B, self.model.config)
        out = self.model(
            input_ids=blocks_NB, attention_mask=batch_kv.attention_mask, position_ids=batch_kv.position_ids,
            use_cache=True, output_hidden_states=True, **{self._cache_kw: batch_kv.cache},
        )
        feats_NBF = self._features(out.hidden_states)
        verdict = speculative_accept(blocks_NB, out.logits, batch, draft_probs_NKV, start_N)
        commit = verdict.accept_lens + 1
        commit_list = commit.tolist()
        for rid, kv in zip(request_ids, split_committed(batch_kv, commit_list)):
            self._kv[rid] = kv
        keep_NB = torch.arange(B, device=self.device) < commit.unsqueeze(1)
        return VerifyResult(
            request_ids=tuple(request_ids),
            accept_lens=verdict.accept_lens,
            bonus=verdict.next_tokens,
            commit_lens=commit,
            committed_ids=blocks_NB[keep_NB],
            features=feats_NBF[keep_NB],
            tested=verdict.tested,
            expected_accepts=verdict.overlap_sum(),
        )

    def release(self, request_id: int) -> None:
        """Drop a finished request's KV and sampling."""
        self._kv.pop(request_id, None)
        self._sampling.pop(request_id, None)

    def seq_len(self, request_id: int) -> int:
        """Tokens in the request's target KV (its committed length)."""
        return seq_len(self._kv[request_id])
