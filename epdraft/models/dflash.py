"""DFlashDraft: a block drafter conditioned on target features (SpecForge DFlash, dense or MoE FFNs).

One propose step per rank: the block [anchor, MASK x (B-1)] of every request of the rank is embedded
with the target's embedding, runs through the layers (attention per request over its cached
context, the FFN once over ALL the rank's rows), and the target's lm_head reads rows 1..B-1 out as
B-1 greedy drafts (mask-filling readout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.errors import ConfigError, NonFiniteError
from epdraft.layers.build import build_ffn
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.models.attention import DFlashAttention, RMSNorm
from epdraft.models.cache import ContextScratch, DraftCache, context_mask, padded_context
from epdraft.models.spec import DraftModelSpec


class TargetHeads(Protocol):
    """What a draft borrows from its target (every `epdraft.target.Target` provides it)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> embeddings [..., H]."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]."""
        ...


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm x); then x + ffn(norm x) over all rows at once."""

    def __init__(
        self,
        spec: DraftModelSpec,
        layer_id: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        dispatcher: Dispatcher | None,
    ):
        super().__init__()
        H = spec.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(H, spec.rms_norm_eps, **kw)
        self.self_attn = DFlashAttention(
            H,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            rms_norm_eps=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,
            bias=spec.attention_bias,
            **kw,
        )
        self.post_attention_layernorm = RMSNorm(H, spec.rms_norm_eps, **kw)
        self.mlp: DraftMLP | DraftMoE = build_ffn(spec.ffn, layer_id, H, dtype=dtype, device=device, dispatcher=dispatcher)

    def forward(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        k_ctx_NgLD: torch.Tensor,
        v_ctx_NgLD: torch.Tensor,
        allowed_NQS: torch.Tensor | None = None,
        plan: StepPlan | None = None,
    ) -> torch.Tensor:
        """x [N, Q, H] -> [N, Q, H]; attention is skipped for N = 0, the FFN never is (it gets the
        step's `plan`, which a communicating MoE layer needs)."""
        N, Q, H = x_NQH.shape
        if N:
            x_NQH = x_NQH + self.self_attn(
                self.input_layernorm(x_NQH), positions_NQ, k_ctx_NgLD, v_ctx_NgLD, allowed_NQS
            )
        # The FFN runs even with no rows: a MoE layer's collectives must be entered by every rank.
        y_TH = self.mlp(self.post_attention_layernorm(x_NQH).reshape(N * Q, H), plan)
        return x_NQH + y_TH.view(N, Q, H)


class DFlashDraft(nn.Module):
    """The DFlash draft. Parameters follow SpecForge's export names: `fc`, `hidden_norm`, `layers.N.*`, `norm`.

    Build with `epdraft.models.load_draft` (weights from an export) or directly for training.
    """

    def __init__(
        self,
        spec: DraftModelSpec,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        dispatcher: Dispatcher | None = None,
    ):
        super().__init__()
        if any(t != "full_attention" for t in spec.layer_types):
            raise ConfigError(f"layer_types {list(spec.layer_types)}: only full_attention draft layers are supported")
        self.spec = spec
        H = spec.hidden_size
        self.fc = nn.Linear(spec.num_target_features * H, H, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DFlashLayer(spec, i, dtype=dtype, device=device, dispatcher=dispatcher) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(H, spec.rms_norm_eps, dtype=dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def device(self) -> torch.device:
        """Where the draft's weights (and so its inputs) live."""
        return self.fc.weight.device

    def new_cache(self) -> DraftCache:
        return DraftCache(self.spec.num_layers)

    def fuse_features(self, features_LF: torch.Tensor) -> torch.Tensor:
        """target_hidden [..., H] = hidden_norm(fc(features)), features [..., K*H] in target_layer_ids order."""
        return self.hidden_norm(self.fc(features_LF.to(self.fc.weight.dtype)))

    def extend_context(self, cache: DraftCache, features_LF: torch.Tensor) -> None:
        """Append the committed rows' target features [L, K*H] to a request's context (local, no FFN)."""
        self.extend_contexts([cache], [features_LF])

    @torch.no_grad()
    def extend_contexts(self, caches: Sequence[DraftCache], features: Sequence[torch.Tensor]) -> None:
        """`extend_context` for many requests at once: one fc and one K/V projection per layer over
        all their new rows (rows are independent: each keeps its own request's positions), then
        each request's slice goes to its cache. Per-request calls are launch-bound on a GPU."""
        lens = [f.shape[0] for f in features]
        if sum(lens) == 0:
            return
        device = features[0].device
        target_hidden = self.fuse_features(torch.cat(list(features))).unsqueeze(0)
        positions = torch.cat(
            [torch.arange(c.length, c.length + n, device=device) for c, n in zip(caches, lens)]
        ).unsqueeze(0)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(target_hidden, positions)
            for cache, k_gLD, v_gLD in zip(caches, k[0].split(lens, dim=1), v[0].split(lens, dim=1)):
                if k_gLD.shape[1]:
                    cache.append(i, k_gLD, v_gLD)
        for cache, n in zip(caches, lens):
            cache.length += n

    def forward(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        target_hidden_NLH: torch.Tensor,
        ctx_positions_NL: torch.Tensor,
        allowed_NQS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Uncached forward (training, tests): final-normed hidden [N, Q, H] of the query rows.

        target_hidden_NLH is already fused (`fuse_features`); allowed_NQS masks keys (context, then
        query rows), e.g. SpecForge's training mask of many blocks over one sequence.
        """
        x = x_NQH
        for layer in self.layers:
            k, v = layer.self_attn.context_kv(target_hidden_NLH, ctx_positions_NL)
            x = layer(x, positions_NQ, k, v, allowed_NQS)
        return self.norm(x)

    def block_hidden(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """Final-normed hidden [N, B, H] of the blocks [anchor, MASK x (B-1)] over each request's context."""
        return self._block_hidden(caches, anchors_N, heads, plan)[0]

    def _block_hidden(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_hidden`, and [num_layers] bool on the device: whether each layer's output is finite.

        The flags stay on the device (no host sync per layer); `propose` reads them once.
        """
        N, B = len(caches), self.spec.block_size
        device = self.fc.weight.device
        ids_NB = torch.full((N, B), self.spec.mask_token_id, dtype=torch.long, device=device)
        ids_NB[:, 0] = anchors_N.to(device)
        x = heads.embed(ids_NB).to(self.fc.weight.dtype)
        starts = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        positions_NB = starts.unsqueeze(1) + torch.arange(B, device=device)
        allowed = context_mask(caches, B, device)
        scratch = ContextScratch()
        finite_L = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k, v = padded_context(caches, i, x, attn.num_kv_heads, attn.head_dim, scratch)
            x = layer(x, positions_NB, k, v, allowed, plan)
            finite_L.append(torch.isfinite(x).all())
        return self.norm(x), torch.stack(finite_L)

    def readout(self, hidden_NQH: torch.Tensor, anchors_N: torch.Tensor, heads: TargetHeads) -> torch.Tensor:
        """Greedy drafts [N, B-1] from the hidden of block rows 1..B-1 (mask-filling readout)."""
        return heads.lm_head(hidden_NQH).argmax(dim=-1)

    @torch.no_grad()
    def propose(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """B-1 greedy drafts [N, B-1] int64 per request; N may be 0 (every FFN still runs once).

        caches[i] holds request i's context (its `length` is the anchor's position); anchors_N [N]
        are the last verified tokens (the verify's bonus, or prefill's first token); `plan` is the
        step's agreed row counts, passed to every MoE layer (None: a single process).

        Raises NonFiniteError naming the first layer whose output went NaN or inf: drafts read
        from it would be garbage that only lowers the accept length, silently.
        """
        hidden, finite_L = self._block_hidden(caches, anchors_N, heads, plan)
        drafts_NB = self.readout(hidden[:, 1:], anchors_N, heads)
        # The step's one host read of the flags, queued after the readout: the caller reads the
        # drafts right after, so on a GPU this sync is the one that would happen anyway.
        if not bool(finite_L.all()):
            layer = int((~finite_L).nonzero()[0, 0])
            raise NonFiniteError(
                f"draft layer {layer}'s hidden states went NaN or inf (over {len(caches)} requests' blocks): its "
                f"weights, or activations overflowing {hidden.dtype}"
            )
        return drafts_NB
