"""HFTarget: a Hugging Face transformers causal LM as the target, replicated on each rank.

Per request it keeps a `DynamicCache` that always holds exactly the committed tokens: verify runs
the block on top of it, then crops the rejected rows away, so the next step sees the same KV a
plain greedy decode would have built. Requests are verified one at a time (correct first; the
tiny CPU target does not need batching).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch

from epdraft.errors import ConfigError, LoadError, RequestError
from epdraft.target.base import PrefillResult, VerifyResult, greedy_accept, validate_prompt


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
        self._caches: dict[int, object] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | Path, feature_layer_ids: Sequence[int], *, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> "HFTarget":
        """Load a saved HF model directory; LoadError names the path when it cannot be read."""
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
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

    def _run(self, ids_T: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ids [T] on top of `cache` (extended in place) -> (greedy preds [T], features [T, K*H])."""
        out = self.model(
            input_ids=ids_T.to(self.device).unsqueeze(0), use_cache=True, output_hidden_states=True, **{self._cache_kw: cache}
        )
        feats = torch.cat([out.hidden_states[j + 1][0] for j in self.feature_layer_ids], dim=-1)
        return out.logits[0].argmax(dim=-1), feats

    @torch.no_grad()
    def prefill(self, request_ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> PrefillResult:
        """Run each prompt into a fresh KV cache: the first token and every prompt row's features.

        Raises RequestError naming the request for an empty prompt or an id outside the vocabulary.
        """
        from transformers import DynamicCache

        firsts, lens, feats = [], [], []
        for rid, prompt in zip(request_ids, prompts, strict=True):
            validate_prompt(rid, prompt, self.vocab_size)
            if rid in self._caches:
                raise RequestError(f"request {rid}: already prefilled on this target")
            cache = DynamicCache(config=self.model.config)
            preds, f = self._run(torch.tensor(prompt, dtype=torch.long), cache)
            self._caches[rid] = cache
            firsts.append(preds[-1])
            lens.append(len(prompt))
            feats.append(f)
        H = self.hidden_size * len(self.feature_layer_ids)
        return PrefillResult(
            request_ids=tuple(request_ids),
            first_tokens=torch.stack(firsts) if firsts else torch.zeros(0, dtype=torch.long),
            prompt_lens=torch.tensor(lens, dtype=torch.long),
            features=torch.cat(feats) if feats else torch.zeros(0, H, device=self.device),
        )

    @torch.no_grad()
    def verify(self, request_ids: Sequence[int], blocks_NB: torch.Tensor) -> VerifyResult:
        """Greedy-verify one block per request; each KV cache keeps only the committed rows."""
        N = blocks_NB.shape[0]
        if len(request_ids) != N:
            raise RequestError(f"verify got {len(request_ids)} request ids for {N} blocks")
        preds, feats = [], []
        for rid, block in zip(request_ids, blocks_NB):
            cache = self._caches.get(rid)
            if cache is None:
                raise RequestError(f"request {rid}: verify before prefill (or after release)")
            p, f = self._run(block, cache)
            preds.append(p)
            feats.append(f)
        pred_NB = torch.stack(preds) if preds else blocks_NB.new_zeros(0, blocks_NB.shape[1])
        blocks_NB = blocks_NB.to(pred_NB.device)
        accept, bonus = greedy_accept(blocks_NB, pred_NB)
        commit = accept + 1
        ids, rows = [], []
        for i, rid in enumerate(request_ids):
            n = int(commit[i])
            cache = self._caches[rid]
            # Rejected rows leave the cache: the next verify starts right after the committed ones.
            if n < blocks_NB.shape[1]:
                cache.crop(n - blocks_NB.shape[1])  # negative = drop that many rows (transformers >= 4.4x)
            ids.append(blocks_NB[i, :n])
            rows.append(feats[i][:n])
        H = self.hidden_size * len(self.feature_layer_ids)
        return VerifyResult(
            request_ids=tuple(request_ids),
            accept_lens=accept,
            bonus=bonus,
            commit_lens=commit,
            committed_ids=torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long),
            features=torch.cat(rows) if rows else torch.zeros(0, H, device=self.device),
        )

    def release(self, request_id: int) -> None:
        """Drop a finished request's KV cache."""
        self._caches.pop(request_id, None)

    def seq_len(self, request_id: int) -> int:
        """Tokens in the request's target KV cache (its committed length)."""
        return self._caches[request_id].get_seq_length()
