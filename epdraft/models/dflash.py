"""DFlashDraft: a block drafter conditioned on target features (SpecForge DFlash, dense or MoE FFNs).

One propose step per rank: the block [anchor, MASK x (B-1)] of every request of the rank is embedded
with the target's embedding, runs through the layers (attention per request over its cached
context, the FFN once over ALL the rank's rows), and the target's lm_head reads the drafts out:
rows 1..B-1 as B-1 greedy drafts (mask-filling readout) or rows 0..B-1 as B (autoregressive).

Full-attention layers see the whole context and the whole block; sliding-window layers see the
context within the window of each query's position and the block causally (SpecForge's training
mask), and cache only the last W-1 context rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.errors import ConfigError, NonFiniteError
from epdraft.kernels.step.ops import flag_nonfinite
from epdraft.layers.build import build_ffn
from epdraft.layers.step_kernels import StepKernels
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.models.attention import DFlashAttention, RMSNorm
from epdraft.models.cache import ContextScratch, DraftCache, context_mask, padded_context
from epdraft.models.kv_pool import KVPool
from epdraft.models.spec import DraftModelSpec


class TargetHeads(Protocol):
    """What a draft borrows from its target (every `epdraft.target.Target` provides it)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> embeddings [..., H]."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]."""
        ...


def check_finite(finite_L: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """Raise NonFiniteError naming the first draft layer whose output went NaN or inf (flags
    [num_layers] bool from a step): drafts read from it would be garbage that only lowers the
    accept length, silently. Reads the flags on the host (one sync)."""
    if not bool(finite_L.all()):
        layer = int((~finite_L).nonzero()[0, 0])
        raise NonFiniteError(
            f"draft layer {layer}'s hidden states went NaN or inf ({what}): its weights, or activations "
            f"overflowing {dtype}"
        )


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
        kernels: StepKernels,
    ):
        super().__init__()
        H = spec.hidden_size
        kw = dict(dtype=dtype, device=device, kernels=kernels)
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
        self.mlp: DraftMLP | DraftMoE = build_ffn(spec.ffn, layer_id, H, dtype=dtype, device=device,
                                                  dispatcher=dispatcher, kernels=kernels)  # fmt: skip
        self.window = spec.window(layer_id)
        self.token_routed = isinstance(self.mlp, DraftMoE) and self.mlp.spec.router.hash_routed

    def forward(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        k_ctx_NgLD: torch.Tensor,
        v_ctx_NgLD: torch.Tensor,
        allowed_NQS: torch.Tensor | None = None,
        plan: StepPlan | None = None,
        input_ids_NQ: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [N, Q, H] -> [N, Q, H]; attention is skipped for N = 0, the FFN never is (it gets the
        step's `plan`, which a communicating MoE layer needs).

        input_ids_NQ: the rows' token ids, which a hash-routed MoE layer routes by (else unused).
        """
        attn = None
        if x_NQH.shape[0]:
            attn = self.self_attn(self.input_layernorm(x_NQH), positions_NQ, k_ctx_NgLD, v_ctx_NgLD, allowed_NQS)
        return self._ffn(x_NQH, attn, plan, input_ids_NQ)

    def _ffn(
        self, x_NQH: torch.Tensor, attn_NQH: torch.Tensor | None, plan: StepPlan | None, input_ids_NQ: torch.Tensor | None
    ) -> torch.Tensor:
        """x' + ffn(norm x') with x' = x + attn (x itself when attention was skipped), over all
        N * Q rows at once; with the Triton step ops the residual adds ride in the norm's and the
        FFN's last launch."""
        N, Q, H = x_NQH.shape
        # The FFN runs even with no rows: a MoE layer's collectives must be entered by every rank.
        if attn_NQH is None:
            h_NQH = self.post_attention_layernorm(x_NQH)
        else:
            h_NQH, x_NQH = self.post_attention_layernorm.add_forward(x_NQH, attn_NQH)
        h_TH, x_TH = h_NQH.reshape(N * Q, H), x_NQH.reshape(N * Q, H)
        if self.token_routed:
            if input_ids_NQ is None:
                raise ConfigError(f"layer {self.mlp.layer_id} is hash-routed: it needs the rows' token ids")
            y_TH = self.mlp(h_TH, plan, input_ids_NQ.reshape(N * Q), residual_TH=x_TH)
        else:
            y_TH = self.mlp(h_TH, plan, residual_TH=x_TH)
        return y_TH.view(N, Q, H)

    def forward_pooled(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        pool: KVPool,
        layer_id: int,
        slots_N: torch.Tensor,
        plan: StepPlan | None,
        input_ids_NQ: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` with the context read in place from `pool` (see DFlashAttention.forward_pooled)."""
        attn = None
        if x_NQH.shape[0]:
            attn = self.self_attn.forward_pooled(
                self.input_layernorm(x_NQH), positions_NQ, pool.k[layer_id], pool.v[layer_id], slots_N, self.window
            )
        return self._ffn(x_NQH, attn, plan, input_ids_NQ)


class DFlashDraft(nn.Module):
    """The DFlash draft. Parameters follow SpecForge's export names: `fc`, `hidden_norm`, `layers.N.*`, `norm`.

    Build with `epdraft.models.load_draft` (weights from an export) or directly for training
    (`kernels=StepKernels.reference()`: the Triton paths have no backward). `kernels`: the rank's
    resolved compute, handed to every layer (None: resolved here for `device`, `dtype`, the spec and
    the dispatcher's layout).
    """

    def __init__(
        self,
        spec: DraftModelSpec,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        dispatcher: Dispatcher | None = None,
        kernels: StepKernels | None = None,
    ):
        super().__init__()
        self.spec = spec
        if kernels is None:
            layout = dispatcher.layout if dispatcher is not None else None
            kernels = StepKernels.resolve(device, dtype, ffn=spec.ffn, layout=layout)
        self.kernels = kernels
        H = spec.hidden_size
        self.fc = nn.Linear(spec.num_target_features * H, H, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(H, spec.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)
        self.layers = nn.ModuleList(
            DFlashLayer(spec, i, dtype=dtype, device=device, dispatcher=dispatcher, kernels=kernels)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(H, spec.rms_norm_eps, dtype=dtype, device=device, kernels=kernels)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def device(self) -> torch.device:
        """Where the draft's weights (and so its inputs) live."""
        return self.fc.weight.device

    @property
    def num_drafts(self) -> int:
        """Drafts `propose` returns per request: B-1 (mask-filling readout) or B (autoregressive)."""
        return self.spec.num_drafts

    def new_cache(self) -> DraftCache:
        return DraftCache(self.spec.num_layers, [self.spec.window(i) for i in range(self.spec.num_layers)])

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
        # A sliding layer's cache keeps only the last W-1 of these rows (DraftCache.append).
        for layer, i, k_gLD, v_gLD in self._context_rows([c.length for c in caches], features):
            caches[i].append(layer, k_gLD, v_gLD)
        for cache, f in zip(caches, features):
            cache.length += f.shape[0]

    def _context_rows(self, starts: Sequence[int], features: Sequence[torch.Tensor]):
        """Yield (layer, request index, k [g, L, D], v) of every request's new rows, request i's
        at positions starts[i]..: one fc and one K/V projection per layer over all the rows."""
        lens = [f.shape[0] for f in features]
        if sum(lens) == 0:
            return
        device = features[0].device
        target_hidden = self.fuse_features(torch.cat(list(features))).unsqueeze(0)
        positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lens)]).unsqueeze(0)
        for layer_id, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(target_hidden, positions)
            for i, (k_gLD, v_gLD) in enumerate(zip(k[0].split(lens, dim=1), v[0].split(lens, dim=1))):
                if k_gLD.shape[1]:
                    yield layer_id, i, k_gLD, v_gLD

    def new_pool(self, *, max_requests: int, max_context: int) -> KVPool:
        """A KV pool for this draft's context K/V, in its weights' dtype and device."""
        attn = self.layers[0].self_attn
        return KVPool(
            self.spec.num_layers, attn.num_kv_heads, attn.head_dim, max_requests=max_requests,
            max_context=max_context, block_size=self.block_size, dtype=self.fc.weight.dtype, device=self.device,
        )  # fmt: skip

    @torch.no_grad()
    def extend_pool(self, pool: KVPool, request_ids: Sequence[int], features: Sequence[torch.Tensor]) -> None:
        """`extend_contexts` into a KV pool: each request's new rows go to its slot, in place.

        Raises RequestError naming draft.max_context (before writing anything) when a request's
        rows do not fit.
        """
        for rid, f in zip(request_ids, features):
            pool.check_room(rid, f.shape[0])
        starts = [pool.length(rid) for rid in request_ids]
        slots = [pool.slot(rid) for rid in request_ids]
        for layer, i, k_gLD, v_gLD in self._context_rows(starts, features):
            pool.write(layer, slots[i], starts[i], k_gLD, v_gLD)
        for rid, f in zip(request_ids, features):
            pool.commit(rid, f.shape[0])

    @torch.no_grad()
    def propose_pooled(
        self, pool: KVPool, slots_N: torch.Tensor, anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None
    ) -> torch.Tensor:
        """`propose` over a KV pool: slots_N [N] int64 (the requests' slots, or the pad slot),
        anchors_N [N] int64, both on the draft's device. Returns drafts [N, num_drafts] int64 and
        [num_layers] bool (each layer's output finite) there, for the caller to check with
        `check_finite` once it reads the drafts anyway.

        No host sync on CUDA and shapes that depend on N only: a CUDA graph can hold it.
        """
        B, device = self.spec.block_size, self.device
        ids_NB, x = self._embed_blocks(anchors_N, heads)
        positions_NB = pool.lengths[slots_N].long().unsqueeze(1) + torch.arange(B, device=device)
        nonfinite_L = torch.zeros(self.spec.num_layers, dtype=torch.int32, device=device)
        for i, layer in enumerate(self.layers):
            x = layer.forward_pooled(x, positions_NB, pool, i, slots_N, plan, ids_NB)
            if self.kernels.step_ops == "triton":
                flag_nonfinite(x, nonfinite_L[i : i + 1])
            else:
                nonfinite_L[i] = ~torch.isfinite(x).all()
        hidden = self.norm(x)
        return self.readout(self.draft_rows(hidden), anchors_N, heads), nonfinite_L == 0

    def forward(
        self,
        x_NQH: torch.Tensor,
        positions_NQ: torch.Tensor,
        target_hidden_NLH: torch.Tensor,
        ctx_positions_NL: torch.Tensor,
        allowed_NQS: torch.Tensor | None = None,
        *,
        sliding_allowed_NQS: torch.Tensor | None = None,
        input_ids_NQ: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Uncached forward (training, tests): final-normed hidden [N, Q, H] of the query rows.

        target_hidden_NLH is already fused (`fuse_features`); allowed_NQS masks keys (context, then
        query rows) of the full-attention layers, sliding_allowed_NQS those of the sliding-window
        layers (required when there are any), e.g. SpecForge's training mask of many blocks over
        one sequence. input_ids_NQ: the query rows' token ids (hash-routed MoE layers need them).
        """
        if sliding_allowed_NQS is None and self.spec.sliding_window is not None:
            raise ConfigError("this draft has sliding_attention layers: pass their mask as sliding_allowed_NQS")
        x = x_NQH
        for layer in self.layers:
            k, v = layer.self_attn.context_kv(target_hidden_NLH, ctx_positions_NL)
            mask = allowed_NQS if layer.window is None else sliding_allowed_NQS
            x = layer(x, positions_NQ, k, v, mask, input_ids_NQ=input_ids_NQ)
        return self.norm(x)

    def block_hidden(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """Final-normed hidden [N, B, H] of the blocks [anchor, MASK x (B-1)] over each request's context."""
        return self._block_hidden(caches, anchors_N, heads, plan)[0]

    def _embed_blocks(self, anchors_N: torch.Tensor, heads: TargetHeads) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks [anchor, MASK x (B-1)]: ids [N, B] and their target embeddings [N, B, H]."""
        ids_NB = torch.full((anchors_N.shape[0], self.spec.block_size), self.spec.mask_token_id, dtype=torch.long,
                            device=self.device)  # fmt: skip
        ids_NB[:, 0] = anchors_N.to(self.device)
        return ids_NB, heads.embed(ids_NB).to(self.fc.weight.dtype)

    def _block_hidden(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_hidden`, and [num_layers] bool on the device: whether each layer's output is finite.

        The flags stay on the device (no host sync per layer); `propose` reads them once.
        """
        B, device = self.spec.block_size, self.device
        ids_NB, x = self._embed_blocks(anchors_N, heads)
        starts = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        positions_NB = starts.unsqueeze(1) + torch.arange(B, device=device)
        # One mask and one scratch per attention kind (full, or the sliding window): their widths differ.
        masks: dict[int | None, torch.Tensor] = {}
        scratches: dict[int | None, ContextScratch] = {}
        finite_L = []
        for i, layer in enumerate(self.layers):
            attn, w = layer.self_attn, layer.window
            if w not in masks:
                masks[w], scratches[w] = context_mask(caches, B, device, w), ContextScratch()
            k, v = padded_context(caches, i, x, attn.num_kv_heads, attn.head_dim, scratches[w])
            x = layer(x, positions_NB, k, v, masks[w], plan, ids_NB)
            finite_L.append(torch.isfinite(x).all())
        return self.norm(x), torch.stack(finite_L)

    def draft_rows(self, hidden_NBH: torch.Tensor) -> torch.Tensor:
        """The block rows that draft a token, in order: rows 1..B-1 (mask-filling) or 0..B-1 (autoregressive)."""
        return hidden_NBH[:, 1:] if self.spec.readout == "mask_filling" else hidden_NBH

    def readout(self, hidden_NkH: torch.Tensor, anchors_N: torch.Tensor, heads: TargetHeads) -> torch.Tensor:
        """Greedy drafts [N, k] from the hidden of the drafting rows (`draft_rows`)."""
        return heads.lm_head(hidden_NkH).argmax(dim=-1)

    @torch.no_grad()
    def propose(
        self, caches: list[DraftCache], anchors_N: torch.Tensor, heads: TargetHeads, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """`num_drafts` greedy drafts [N, num_drafts] int64 per request; N may be 0 (every FFN still runs once).

        caches[i] holds request i's context (its `length` is the anchor's position); anchors_N [N]
        are the last verified tokens (the verify's bonus, or prefill's first token); `plan` is the
        step's agreed row counts, passed to every MoE layer (None: a single process).

        Raises NonFiniteError naming the first layer whose output went NaN or inf: drafts read
        from it would be garbage that only lowers the accept length, silently.
        """
        hidden, finite_L = self._block_hidden(caches, anchors_N, heads, plan)
        drafts = self.readout(self.draft_rows(hidden), anchors_N, heads)
        # The step's one host read of the flags, queued after the readout: the caller reads the
        # drafts right after, so on a GPU this sync is the one that would happen anyway.
        check_finite(finite_L, f"over {len(caches)} requests' blocks", hidden.dtype)
        return drafts
