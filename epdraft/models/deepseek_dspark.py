"""DeepseekDSparkDraft: SpecForge's DeepSeek-V4 / V4.1 DSpark draft (`DSparkV4DraftModel`, issue 31), served.

Each request's context is the fused target features main = main_norm(main_proj(features)); every
layer projects it to one K=V row per position (`DeepseekDSparkAttention.context_kv`), of which the
pool keeps the last `window` (`WindowKVPool`). A step embeds the blocks [anchor, MASK x (B-1)] at
positions length .. length + B - 1, copies them to hc_mult residual streams and runs the layers:

    streams = attn_hc(streams, attn(attn_norm(.)))   # window rows before the anchor + the whole block
    streams = ffn_hc(streams, mlp(ffn_norm(.)))      # once over ALL the rank's N * B rows (N may be 0)

then the readout collapses the streams into the pre-norm hidden (which the confidence head reads):
V4's `HyperHead`, V4.1's last lagged pre mix (`single_pass_readout`, no `hc_head` tensors). The
final norm and the target's lm_head give base logits, and the vanilla Markov head decodes the drafts
semi-autoregressively (`MarkovHead`, SpecForge's `VanillaMarkovHead` names). The confidence head is
SpecForge's `DSparkV4ConfidenceHead`: bias-free fp32 proj over [pre-norm hidden, markov_w1(prev)],
read out through a sigmoid as an accept probability.

V4.1 (`spec.deepseek.variant == "v41"`: no per-head q norm, single-pass mHC, that readout) is built
from the architecture description (reference draft_models.md 6b), not yet checked against a released
V4.1 export.

On CUDA the norms and the mHC mixing run as Triton launches with the step's other small ops
(`kernels.step.hc`, when `kernels.step_ops` is "triton") and the attention proper as one launch
(`kernels.step.sink_attention`, with `kernels.attention`); the K=V row's FP8 round trip and rotary
as one launch too (`kernels.step.kv_finish`, with the step ops), which in a commit also writes the
rows into the ring. The projections and the queries' rotary stay torch. The step has no host sync, so
`draft.cuda_graphs` replays it from a CUDA graph per bucket like DFlash's (`runtime.graphs`).

Shape legend: N requests, B block rows, H hidden, c hc_mult streams, W window, D head_dim, k drafts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from epdraft.dispatch import Dispatcher, StepPlan
from epdraft.errors import ConfigError
from epdraft.layers.build import build_ffn
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.moe import DraftMoE
from epdraft.layers.step_kernels import StepKernels
from epdraft.models.deepseek_attention import DeepseekDSparkAttention, DeepseekRMSNorm
from epdraft.models.dflash import SampledReadout, TargetHeads
from epdraft.models.dspark import MarkovHead
from epdraft.models.hyper_connections import HyperConnection, HyperHead, Streams, enter_streams, single_pass_readout
from epdraft.models.kv_pool import WindowKVPool
from epdraft.models.spec import DraftModelSpec
from epdraft.models.step import DraftStep
from epdraft.sampling import Readout


class DeepseekDSparkLayer(nn.Module):
    """One `mtp.{i}` stage: mHC-wrapped attention over [window, block], mHC-wrapped FFN over all rows."""

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
        d, H, eps = spec.deepseek, spec.hidden_size, spec.rms_norm_eps
        fused = kernels.step_ops == "triton"  # the mHC mixing and the norms as Triton launches
        hc = dict(hc_mult=d.hc_mult, sinkhorn_iters=d.hc_sinkhorn_iters, hc_eps=d.hc_eps, norm_eps=eps,
                  single_pass=d.single_pass, fused=fused, device=device)  # fmt: skip
        self.attn_hc = HyperConnection(H, **hc)
        self.attn_norm = DeepseekRMSNorm(H, eps, fused=fused, dtype=dtype, device=device)
        self.attn = DeepseekDSparkAttention(
            H, spec.num_heads, d.q_lora_rank, spec.head_dim, d.rope_head_dim, d.o_groups, d.o_lora_rank,
            rope_theta=spec.rope_theta, rms_norm_eps=eps, q_norm=d.q_norm, kv_fake_quant=d.kv_fake_quant,
            fused_norms=fused, fused_attention=kernels.attention == "triton", fused_kv=fused, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.ffn_hc = HyperConnection(H, **hc)
        self.ffn_norm = DeepseekRMSNorm(H, eps, fused=fused, dtype=dtype, device=device)
        self.mlp: DraftMLP | DraftMoE = build_ffn(spec.ffn, layer_id, H, dtype=dtype, device=device,
                                                  dispatcher=dispatcher, kernels=kernels)  # fmt: skip

    def forward(
        self,
        streams: Streams,
        positions_NB: torch.Tensor,
        kv_ctx_NSD: torch.Tensor,
        ctx_valid_NS: torch.Tensor,
        plan: StepPlan | None,
    ) -> Streams:
        """Streams of N * B rows (request-major) -> new streams; attention is skipped for N = 0, the
        FFN never is (a communicating MoE layer's collectives need every rank, with `plan`)."""
        N, B = positions_NB.shape
        h_TH, m = self.attn_hc.read_input(streams)
        if N:
            h_TH = self.attn(self.attn_norm(h_TH).view(N, B, -1), positions_NB, kv_ctx_NSD, ctx_valid_NS).flatten(0, 1)
        streams = self.attn_hc.write_output(h_TH, streams, m)  # N = 0: h_TH is [0, H], nothing is written
        h_TH, m = self.ffn_hc.read_input(streams)
        return self.ffn_hc.write_output(self.mlp(self.ffn_norm(h_TH), plan), streams, m)


class DeepseekDSparkDraft(nn.Module):
    """The DeepSeek-V4 / V4.1 DSpark draft (kind "dspark_v4"). Parameters: `main_proj`, `main_norm`,
    `layers.{i}.{attn_hc,attn_norm,attn,ffn_hc,ffn_norm,mlp}.*`, `hc_head.*` (V4 only), `norm`, `markov_head.*`,
    `confidence_head.proj.weight`; `epdraft.models.deepseek_names` maps SpecForge's `mtp.*` export
    names onto them.

    `kernels`: the rank's resolved compute for the FFN (None: resolved for `device`, `dtype`, the
    spec and the dispatcher's layout).
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
        if spec.deepseek is None:
            raise ConfigError(f"kind = {spec.kind!r}: DeepseekDSparkDraft serves dspark_v4 drafts only")
        if kernels is None:
            layout = dispatcher.layout if dispatcher is not None else None
            kernels = StepKernels.resolve(device, dtype, ffn=spec.ffn, layout=layout)
        self.spec, self.kernels = spec, kernels
        H, d = spec.hidden_size, spec.deepseek
        self.main_proj = nn.Linear(spec.num_target_features * H, H, bias=False, dtype=dtype, device=device)
        fused = kernels.step_ops == "triton"
        self.main_norm = DeepseekRMSNorm(H, spec.rms_norm_eps, fused=fused, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DeepseekDSparkLayer(spec, i, dtype=dtype, device=device, dispatcher=dispatcher, kernels=kernels)
            for i in range(spec.num_layers)
        )
        # V4.1 reads out with the lagged pre mix the streams carry: no readout weights.
        self.hc_head: HyperHead | None = None if d.single_pass else HyperHead(H, hc_mult=d.hc_mult, hc_eps=d.hc_eps,
                                                             norm_eps=spec.rms_norm_eps, device=device)  # fmt: skip
        self.norm = DeepseekRMSNorm(H, spec.rms_norm_eps, fused=fused, dtype=dtype, device=device)
        self.markov_head = MarkovHead("vanilla", spec.vocab_size, spec.markov_rank, H, dtype=dtype, device=device,
                                      fused_readout=kernels.sampling == "triton")  # fmt: skip
        # The export always holds the confidence head; `enable_confidence_head` says whether to report it.
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(H + spec.markov_rank, 1, bias=False, dtype=torch.float32, device=device)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_drafts(self) -> int:
        return self.spec.num_drafts

    @property
    def device(self) -> torch.device:
        return self.main_proj.weight.device

    @property
    def window(self) -> int:
        return self.spec.deepseek.window

    def fuse_features(self, features_LF: torch.Tensor) -> torch.Tensor:
        """main [..., H] = main_norm(main_proj(features)), features [..., K*H] in target_layer_ids order."""
        return self.main_norm(self.main_proj(features_LF.to(self.main_proj.weight.dtype)))

    def new_pool(self, *, max_requests: int, max_context: int) -> WindowKVPool:
        """Rings of the last `window` K=V rows per request and layer, in the weights' dtype and device."""
        return WindowKVPool(
            self.spec.num_layers, self.spec.head_dim, window=self.window, max_requests=max_requests,
            max_context=max_context, block_size=self.block_size, dtype=self.main_proj.weight.dtype,
            device=self.device,
        )  # fmt: skip

    @torch.no_grad()
    def extend(self, pool: WindowKVPool, request_ids: Sequence[int], features: Sequence[torch.Tensor]) -> None:
        """Append each request's committed rows' target features [L_i, K*H] to its ring (local, no
        FFN; `write_context` over the rows packed). Raises RequestError naming draft.max_context
        (before writing anything) when a request outgrows it."""
        pool.append(request_ids, features, functools.partial(self.write_context, pool))

    @torch.no_grad()
    def write_context(
        self, pool: WindowKVPool, slots_N: torch.Tensor, counts_N: torch.Tensor, features_TF: torch.Tensor
    ) -> None:
        """The device side of a commit: request i's counts_N[i] rows, packed in order in features_TF
        [T, K*H] (rows past their sum are padding), fused once and through every layer's K=V
        projection into the slots' rings at their positions (only each request's last `window`
        rows are kept), then the lengths advance. N >= 1; fixed shapes, no host sync: a CUDA graph
        can hold it (`CommitGraphs`)."""
        triton = self.kernels.step_ops == "triton"
        slot_T, position_T = pool.placement(slots_N, counts_N, features_TF.shape[0], triton=triton)
        main_TH = self.fuse_features(features_TF.to(self.device))
        rope = self.layers[0].attn.rope(position_T)  # every layer rotates alike: one table for all
        for layer_id, layer in enumerate(self.layers):
            if layer.attn.fused_kv:  # the K=V rows' finish and the ring write in one launch
                layer.attn.store_context_kv(main_TH, rope, slot_T, position_T, pool.kv[layer_id])
            else:
                pool.store(layer_id, slot_T, position_T, layer.attn.context_kv(main_TH, position_T, rope))
        pool.advance(slots_N, counts_N)

    @torch.no_grad()
    def step(
        self,
        pool: WindowKVPool,
        slots_N: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        plan: StepPlan | None,
        *,
        readout: Readout = Readout.ARGMAX,
    ) -> DraftStep:
        """The draft step of N requests (N may be 0: every MoE layer still enters its collectives
        with `plan`), each block reading its request's ring; drafts as `DFlashDraft.step` returns them."""
        lengths_N = pool.lengths[slots_N].long()
        windows = [pool.window_of(i, slots_N) for i in range(self.spec.num_layers)]
        prenorm_NBH, finite_L = self.block_hidden(anchors_N, lengths_N, windows, heads, plan)
        sampling = None
        if readout is not Readout.ARGMAX:
            sampling = SampledReadout(pool.sampling_of(slots_N, readout), lengths_N + 1)
        drafts_NK, confidence_NK, probs_NKV = self.read_out(self.draft_rows(prenorm_NBH), anchors_N, heads, sampling)
        return DraftStep(drafts_NK, finite_L, confidence_NK, probs_NKV)

    def block_hidden(
        self,
        anchors_N: torch.Tensor,
        lengths_N: torch.Tensor,
        windows: Sequence[tuple[torch.Tensor, torch.Tensor]],
        heads: TargetHeads,
        plan: StepPlan | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm hidden [N, B, H] of the blocks at positions length .., [num_layers] bool: each
        layer's streams stayed finite). windows[i] = (kv [N, S, D], valid [N, S]): layer i's context
        rows of each request (the pool's ring, or a reference's gathered window)."""
        N, B, H = anchors_N.shape[0], self.block_size, self.spec.hidden_size
        positions_NB = lengths_N.unsqueeze(1) + torch.arange(B, device=self.device)
        ids_NB = torch.full((N, B), self.spec.mask_token_id, dtype=torch.long, device=self.device)
        ids_NB[:, 0] = anchors_N.to(self.device)
        x_TH = heads.embed(ids_NB).to(self.main_proj.weight.dtype).reshape(N * B, H)
        d = self.spec.deepseek
        streams = enter_streams(x_TH, d.hc_mult, single_pass=d.single_pass)
        finite = []
        for layer, (kv_NSD, valid_NS) in zip(self.layers, windows):
            streams = layer(streams, positions_NB, kv_NSD, valid_NS, plan)
            finite.append(torch.isfinite(streams.x_NcH).all())
        hidden_TH = single_pass_readout(streams) if d.single_pass else self.hc_head(streams.x_NcH)
        return hidden_TH.view(N, B, H), torch.stack(finite)

    def draft_rows(self, hidden_NBH: torch.Tensor) -> torch.Tensor:
        """The block rows that draft a token: rows 1..B-1 (mask-filling) or 0..B-1 (autoregressive)."""
        return hidden_NBH[:, 1:] if self.spec.readout == "mask_filling" else hidden_NBH

    def read_out(
        self,
        prenorm_NkH: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        sampling: SampledReadout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(drafts [N, k], confidence [N, k] fp32 or None, q [N, k, V] fp32 or None) from the drafting
        rows' PRE-norm hidden (the confidence head reads it; the lm_head reads it normed)."""
        hidden_NkH = self.norm(prenorm_NkH)
        drafts, probs = self.markov_head.decode(heads.lm_head(hidden_NkH), hidden_NkH, anchors_N, sampling)
        if not self.spec.enable_confidence_head:
            return drafts, None, probs
        prev_Nk = torch.cat([anchors_N.to(drafts.device).unsqueeze(1), drafts[:, :-1]], dim=1)
        inputs = torch.cat([prenorm_NkH.float(), self.markov_head.markov_w1(prev_Nk).float()], dim=-1)
        return drafts, torch.sigmoid(self.confidence_head.proj(inputs)).squeeze(-1), probs
