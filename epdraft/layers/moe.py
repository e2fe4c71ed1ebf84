"""DraftMoE: router -> dispatch -> routed experts -> combine (+ shared expert), on every rank."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.config.quant import QuantSpec
from epdraft.dispatch import Dispatcher, MoeLayout, ReplicatedDispatcher, StepPlan
from epdraft.kernels.launch import Fork
from epdraft.kernels.step.ops import Epilogue, ffn_residual, refuse_epilogue
from epdraft.layers.mlp import DraftMLP
from epdraft.layers.routed_experts import RoutedExperts
from epdraft.layers.router import Router
from epdraft.layers.step_kernels import StepKernels
from epdraft.loading import ExpertShard, TensorSource, check_ffn_loaded, load_into


class DraftMoE(nn.Module):
    """One MoE FFN layer: this rank's experts as `dispatcher.layout` places them (default: all of them).

    Submodules (canonical loader names): `router` (fp32 `weight [E, H]`, `bias [E]`), `experts`
    (`w13 [e, 2F, H]`, `w2 [e, H, F]`, `b13`, `b2`), `shared` (DraftMLP of width S with an optional
    `output_gate`) when the spec has a shared expert. The shared expert is replicated: it runs on
    this rank's own tokens, outside the collectives (with `kernels.side_stream`, on a second CUDA
    stream beside them). `kernels`: the rank's resolved compute (None:
    resolved for `device`, `dtype` and this layer); its `quantized_experts` keeps a quantized
    checkpoint's experts quantized for the fused kernels, else they are dequantized at load.
    `quantization`: how the checkpoint stores the layer's tensors (default: the spec's, set when its
    routed experts are quantized): raw stored tensors handed to `load_weights` are read through it.
    """

    def __init__(
        self,
        spec: DraftMoeFFNSpec,
        hidden_size: int,
        *,
        layer_id: int | None = None,
        dispatcher: Dispatcher | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: StepKernels | None = None,
        quantization: QuantSpec | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.quantization = quantization if quantization is not None else spec.quantization
        self.layer_id = layer_id
        if dispatcher is None:
            dispatcher = ReplicatedDispatcher(MoeLayout.local(spec.num_experts, hidden_size, spec.top_k))
        self.dispatcher = dispatcher
        layout = dispatcher.layout
        if kernels is None:
            ffn = DraftMixFFNSpec(family="moe", hidden_size=hidden_size, layers=(spec,))
            kernels = StepKernels.for_device(device, dtype, ffn=ffn, layout=layout)
        self.kernels = kernels
        shard = ExpertShard(
            num_experts=spec.num_experts,
            intermediate_size=spec.intermediate_size,
            hidden_size=hidden_size,
            ep_rank=layout.ep_rank,
            ep_size=layout.ep_size,
            tp_rank=layout.tp_rank,
            tp_size=layout.tp_size,
            transposed_interleaved=spec.activation.kind == "swigluoai",
            layer_id=layer_id,
        )
        self.router = Router(spec.router, hidden_size, device=device, kernels=kernels)
        self.experts = RoutedExperts(
            shard, spec.activation, bias=spec.expert_bias, dtype=dtype, device=device, kernels=kernels,
            quantization=spec.quantization.experts if kernels.quantized_experts and spec.quantization else None,
        )  # fmt: skip
        self.shared: DraftMLP | None = None
        if spec.shared_intermediate_size > 0:
            self.shared = DraftMLP(
                hidden_size,
                spec.shared_intermediate_size,
                spec.activation,
                output_gate=spec.shared_gate,
                layer_id=layer_id,
                dtype=dtype,
                device=device,
                kernels=kernels,
            )
        self.loaded_pieces: set = set()

    @property
    def expert_shard(self) -> ExpertShard:
        return self.experts.shard

    def forward(
        self,
        x_TH: torch.Tensor,
        plan: StepPlan | None = None,
        input_ids_T: torch.Tensor | None = None,
        *,
        residual_TH: torch.Tensor | None = None,
        epilogue: Epilogue | None = None,
    ) -> torch.Tensor:
        """x_TH [T, H] -> [T, H] in x's dtype, plus `residual_TH` when given (the layer's residual
        add: with the Triton step ops it rides in one launch with the shared expert's gate and add,
        which with `epilogue` also writes the next norm and the layer's non-finite flag); `plan` is the
        step's agreed row counts (any communicating layout needs it, replicated ignores it);
        input_ids_T [T] int64 the rows' token ids, which a hash-routed layer routes by (routing is
        local, before dispatch: no layout needs them).

        T = 0 still routes, dispatches and combines: every rank of the MoE group enters every
        collective of every layer, or the ranks with tokens hang.
        """
        fork = Fork(x_TH.device) if self.shared is not None and self.kernels.side_stream else None
        if fork is not None:
            with fork.side():
                shared_TH = self.shared.ungated(x_TH)
        ids_TK, weights_TK = self.router(x_TH, input_ids_T)
        dispatcher = self.dispatcher
        handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK, plan)
        y_TH = dispatcher.combine(self.experts(handle.rows_RH, handle.ids_RK, handle.weights_RK), handle)
        if fork is not None:
            fork.join()  # x_TH and shared_TH stay referenced past it
        else:
            shared_TH = self.shared.ungated(x_TH) if self.shared is not None else None
        if self.kernels.step_ops == "triton" and shared_TH is not None:
            return self.shared.add_gated(x_TH, shared_TH, residual_TH, routed_TH=y_TH, epilogue=epilogue)
        if self.kernels.step_ops == "triton" and residual_TH is not None:
            return ffn_residual(residual_TH, y_TH, epilogue=epilogue)
        refuse_epilogue("DraftMoE", epilogue)
        if shared_TH is not None:
            y_TH = y_TH + self.shared.gated(x_TH, shared_TH)
        return y_TH if residual_TH is None else residual_TH + y_TH

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | TensorSource) -> set[str]:
        """Copy this layer's tensors (only this rank's experts and slice) from any accepted naming.

        Returns the names accounted for (copied here, or other ranks' experts); other layers' and
        unknown names are ignored. Raises LoadError on a shape mismatch, naming the tensor and both
        shapes, and on a tensor the config has no place for. Experts already prepared for the
        kernels (`RoutedExperts.pack_for_kernels`) are loaded in checkpoint order and prepared again after.
        """
        prepared = self.experts.unpack_for_loading()
        names = load_into(self, named_tensors, self.layer_id)
        if prepared:
            self.experts.pack_for_kernels(f"layers.{self.layer_id}.mlp.experts")
        return names

    def check_loaded(self) -> None:
        """Raise LoadError listing every tensor this layer still lacks (this rank's experts only)."""
        check_ffn_loaded(self, self.layer_id)
