"""DFlashDraft: a block drafter conditioned on target features (SpecForge DFlash, dense or MoE FFNs).

One step per rank (`DFlashDraft.step`): the block [anchor, MASK x (B-1)] of every request of the
rank is embedded with the target's embedding, runs through the layers (attention per request over
its context, read in place from the KV pool; the FFN once over ALL the rank's rows), and the
target's lm_head reads the drafts out: rows 1..B-1 as B-1 greedy drafts (mask-filling readout) or
rows 0..B-1 as B (autoregressive). `extend` writes committed rows' context K/V into the pool.

Full-attention layers see the whole context and the whole block; sliding-window layers see the
context within the window of each query's position and the block causally (SpecForge's training
mask). `epdraft.models.reference` runs the same layers over per-request caches: the tests' oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.errors import ConfigError, NonFiniteError
from epdraft.kernels.launch import Fork
from epdraft.kernels.sample.argmax import argmax_rows
from epdraft.kernels.step.ops import Epilogue, step_blocks
from epdraft.layers.build import build_ffn
from epdraft.layers.step_kernels import StepKernels
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.models.attention import DFlashAttention, RMSNorm, rope_cos_sin
from epdraft.models.kv_pool import KVPool
from epdraft.models.spec import DraftModelSpec
from epdraft.models.step import DraftStep
from epdraft.sampling import Readout, SamplingBatch, propose_tokens


@dataclasses.dataclass(frozen=True)
class SampledReadout:
    """A sampled step's readout inputs: the requests' sampling rows, and the sequence position of
    each request's first draft [N] int64 (draft i decides position first_N + i)."""

    batch: SamplingBatch
    first_N: torch.Tensor


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
        self,
        x_NQH: torch.Tensor,
        attn_NQH: torch.Tensor | None,
        plan: StepPlan | None,
        input_ids_NQ: torch.Tensor | None,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor:
        """x' + ffn(norm x') with x' = x + attn (x itself when attention was skipped), over all
        N * Q rows at once; with the Triton step ops the residual adds ride in the norm's and the
        FFN's last launch (which with `epilogue` also writes the next norm and the flag)."""
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
            y_TH = self.mlp(h_TH, plan, input_ids_NQ.reshape(N * Q), residual_TH=x_TH, epilogue=epilogue)
        else:
            y_TH = self.mlp(h_TH, plan, residual_TH=x_TH, epilogue=epilogue)
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
        ends_N: torch.Tensor,
        *,
        normed_NQH: torch.Tensor | None = None,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor:
        """`forward` with the context read in place from `pool` (see DFlashAttention.forward_pooled;
        ends_N, each request's last position + 1, computed once a step rather than once a layer).
        With the Triton step ops the step chains the layers' norms: `normed_NQH` is this layer's
        input norm of x already made (by the layer before's `epilogue`), and `epilogue` has this
        layer's last launch make the next one's (`step_ops.Epilogue`)."""
        attn = None
        if x_NQH.shape[0]:
            h_NQH = normed_NQH if normed_NQH is not None else self.input_layernorm(x_NQH)
            attn = self.self_attn.forward_pooled(
                h_NQH, positions_NQ, pool.k[layer_id], pool.v[layer_id], slots_N, self.window, ends_N
            )
        return self._ffn(x_NQH, attn, plan, input_ids_NQ, epilogue)


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
        """Drafts a step returns per request: B-1 (mask-filling readout) or B (autoregressive)."""
        return self.spec.num_drafts

    def fuse_features(self, features_LF: torch.Tensor) -> torch.Tensor:
        """target_hidden [..., H] = hidden_norm(fc(features)), features [..., K*H] in target_layer_ids order."""
        return self.hidden_norm(self.fc(features_LF.to(self.fc.weight.dtype)))

    def context_rows(self, starts: Sequence[int], features: Sequence[torch.Tensor]):
        """Yield (layer, request index, k [g, L, D], v) of every request's new context rows, request
        i's at positions starts[i]..: one fc and one K/V projection per layer over all the requests'
        rows (rows are independent; per-request calls are launch-bound on a GPU)."""
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
    def extend(self, pool: KVPool, request_ids: Sequence[int], features: Sequence[torch.Tensor]) -> None:
        """Append each request's committed rows' target features [L_i, K*H] to its context in `pool`
        (local, no FFN): each request's new K/V rows go to its slot, in place (`write_context` over
        the rows packed). Raises RequestError naming draft.max_context (before writing anything)
        when a request's rows do not fit."""
        pool.append(request_ids, features, functools.partial(self.write_context, pool))

    @torch.no_grad()
    def write_context(
        self, pool: KVPool, slots_N: torch.Tensor, counts_N: torch.Tensor, features_TF: torch.Tensor
    ) -> None:
        """The device side of a commit: request i's counts_N[i] rows, packed in order in features_TF
        [T, K*H] (rows past their sum are padding), through fc, hidden_norm and every layer's K/V
        projection (k normed and rotated at its position) into slots_N's rows after their lengths,
        which then advance. N >= 1; shapes depend on N and T only and nothing waits for the
        host: a CUDA graph can hold it (`CommitGraphs`). The host's lengths are the caller's (`pool.append`)."""
        triton = self.kernels.step_ops == "triton"
        slot_T, position_T = pool.placement(slots_N, counts_N, features_TF.shape[0], triton=triton)
        hidden_TH = self.fuse_features(features_TF)
        if self.kernels.step_ops == "triton":
            # every layer's K/V reads the same rows: odd layers' on the side stream beside the even
            # ones', forked after layer 0, which made the rotary table all of them read (`rope_table`)
            fork = None
            for layer_id, layer in enumerate(self.layers):
                if layer_id == 1 and self.kernels.side_stream:
                    fork = Fork(hidden_TH.device)
                with fork.side() if fork is not None and layer_id % 2 else contextlib.nullcontext():
                    layer.self_attn.store_context(hidden_TH, position_T, slot_T, pool.k[layer_id], pool.v[layer_id])
            if fork is not None:
                fork.join()  # hidden_TH, position_T and slot_T stay referenced past it
        else:
            attn = self.layers[0].self_attn  # every layer rotates alike: one rotary table for all
            rope = rope_cos_sin(position_T.unsqueeze(0), attn.head_dim, attn.rope_theta)
            for layer_id, layer in enumerate(self.layers):
                k, v = layer.self_attn.context_kv(hidden_TH.unsqueeze(0), position_T.unsqueeze(0), rope)
                pool.store(layer_id, slot_T, position_T, k[0].transpose(0, 1), v[0].transpose(0, 1))
        pool.advance(slots_N, counts_N)

    @torch.no_grad()
    def step(
        self,
        pool: KVPool,
        slots_N: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        plan: StepPlan | None,
        *,
        readout: Readout = Readout.ARGMAX,
    ) -> DraftStep:
        """The draft step: the blocks [anchor, MASK x (B-1)] of N requests through every layer, each
        request's context read in place from `pool`, the FFN once over all N * B rows (N may be 0:
        every MoE layer still enters its collectives with `plan`, the step's agreed row counts;
        None: a single process), then the drafts read out.

        slots_N [N] int64 (the requests' slots, or the pad slot), anchors_N [N] int64 (the last
        verified tokens), both on the draft's device. No host sync on CUDA and shapes that depend
        on N only: a CUDA graph can hold it. The caller checks `DraftStep.finite_L` with
        `check_finite` once it reads the drafts anyway.

        readout: `Readout.ARGMAX` (every request greedy): argmax drafts. Otherwise each draft is
        drawn from its request's processed logits (the sampling its pool slot holds; greedy slots
        take the argmax; `pool.readout(ids)` says which) and the proposal distributions come back
        in `DraftStep.probs_NKV`.
        """
        ids_NB, positions_NB, ends_N, nonfinite_L = self.block_inputs(anchors_N, slots_N, pool.lengths)
        x = heads.embed(ids_NB).to(self.fc.weight.dtype)
        if self.kernels.step_ops == "triton":
            # each layer's last launch also makes the next layer's input norm (the last layer's: the
            # final norm) and its non-finite flag
            normed = None
            norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for i, (layer, norm) in enumerate(zip(self.layers, norms)):
                epilogue = Epilogue(norm.weight, norm.eps, torch.empty_like(x).flatten(0, -2), nonfinite_L[i : i + 1])
                x = layer.forward_pooled(x, positions_NB, pool, i, slots_N, plan, ids_NB, ends_N, normed_NQH=normed,
                                         epilogue=epilogue)  # fmt: skip
                normed = epilogue.normed_TH.view(x.shape)
        else:
            for i, layer in enumerate(self.layers):
                x = layer.forward_pooled(x, positions_NB, pool, i, slots_N, plan, ids_NB, ends_N)
                nonfinite_L[i] = ~torch.isfinite(x).all()
            normed = self.norm(x)
        sampling = None
        if readout is not Readout.ARGMAX:
            first_N = positions_NB[:, 0] + 1  # the sequence position of each request's first draft
            sampling = SampledReadout(pool.sampling_of(slots_N, readout), first_N)
        drafts_NK, confidence_NK, probs_NKV = self.read_out(self.draft_rows(normed), anchors_N, heads, sampling)
        return DraftStep(drafts_NK, nonfinite_L == 0, confidence_NK, probs_NKV)

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

    def block_inputs(
        self, anchors_N: torch.Tensor, slots_N: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a step's layers read besides the embeddings: the blocks' ids [N, B] (anchor, then MASK),
        their positions lengths[slots_N] + [0, B), each request's attention end (its last position + 1,
        made once a step rather than once a layer) and the L layers' non-finite flags zeroed. One
        launch with the Triton step ops (`step_ops.step_blocks`), a short torch chain without."""
        B, L = self.spec.block_size, self.spec.num_layers
        if self.kernels.step_ops == "triton":
            return step_blocks(anchors_N, slots_N, lengths, self.spec.mask_token_id, B, L)
        positions_NB = lengths[slots_N].long().unsqueeze(1) + torch.arange(B, device=self.device)
        zeros_L = torch.zeros(L, dtype=torch.int32, device=self.device)
        return self.block_ids(anchors_N), positions_NB, positions_NB[:, -1] + 1, zeros_L

    def block_ids(self, anchors_N: torch.Tensor) -> torch.Tensor:
        """The blocks [anchor, MASK x (B-1)] as ids [N, B] int64 (the torch chain)."""
        ids_NB = torch.full((anchors_N.shape[0], self.spec.block_size), self.spec.mask_token_id, dtype=torch.long,
                            device=self.device)  # fmt: skip
        ids_NB[:, 0] = anchors_N.to(self.device)
        return ids_NB

    def embed_blocks(self, anchors_N: torch.Tensor, heads: TargetHeads) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks [anchor, MASK x (B-1)]: ids [N, B] and their target embeddings [N, B, H]."""
        ids_NB = self.block_ids(anchors_N)
        return ids_NB, heads.embed(ids_NB).to(self.fc.weight.dtype)

    def draft_rows(self, hidden_NBH: torch.Tensor) -> torch.Tensor:
        """The block rows that draft a token, in order: rows 1..B-1 (mask-filling) or 0..B-1 (autoregressive)."""
        return hidden_NBH[:, 1:] if self.spec.readout == "mask_filling" else hidden_NBH

    def read_out(
        self,
        hidden_NkH: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        sampling: SampledReadout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(drafts [N, k] int64, None: DFlash has no confidence, q [N, k, V] fp32 or None) from the
        drafting rows' hidden: argmax drafts, or with `sampling` drafts sampled from the processed
        logits (every position at once: DFlash's drafts are independent given the block)."""
        logits_NkV = heads.lm_head(hidden_NkH)
        if sampling is None:
            if self.kernels.sampling == "triton":
                return argmax_rows(logits_NkV.flatten(0, -2)).view(logits_NkV.shape[:-1]), None, None
            return logits_NkV.argmax(dim=-1), None, None
        drafts_NK, q_NkV = propose_tokens(logits_NkV, sampling.batch, sampling.first_N,
                                          fused=self.kernels.sampling == "triton")  # fmt: skip
        return drafts_NK, None, q_NkV
