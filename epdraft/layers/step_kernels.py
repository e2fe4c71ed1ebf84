"""StepKernels: which implementation runs each op of one rank's draft step, resolved once.

The compute side's twin of `MoeLayout`: the device, the dtype, the draft's FFN spec, the MoE layout
and `draft.cuda_graphs` decide once per rank which kernel family runs each op; layers and models
receive the value at construction and pick their forward there, never per call (CONVENTIONS 10b).
Only shape thresholds (the rows at which a launch hands over to cuBLAS) stay per call, inside each
family (`epdraft.kernels`).

    kernels = StepKernels.resolve(device, dtype, ffn=spec.ffn, layout=layout, graphs=pc.draft.cuda_graphs)
    draft = load_draft(path, spec=spec, dtype=dtype, device=device, dispatcher=d, kernels=kernels)

    op                 implementations
    step_ops           "triton": norms with the residual add, q/k norm + rotary + KV-pool write, the
                       router's logits and top-k, gated activation, the FFN output add, non-finite
                       flags (`kernels.step.ops`), a DeepSeek DSpark draft's mHC mixing
                       (`kernels.step.hc`); "torch": the torch chains they equal
    projections        "skinny": one launch per projection group up to `skinny.MAX_ROWS` rows,
                       cuBLAS above (`kernels.step.skinny`); "torch": nn.Linear
    attention          "triton": block attention read in place from the KV pool
                       (`kernels.step.attention`), a DeepSeek DSpark draft's sink attention over its
                       window (`kernels.step.sink_attention`); "torch": the SDPA / torch references
    experts            "fused": the fused expert kernels (`kernels.experts.fused`); "reference":
                       the per-expert loop (`layers.experts`)
    quantized_experts  the routed experts stay FP8 / MXFP4 as stored and the fused kernels decode
                       them; False: a quantized checkpoint is dequantized to the draft's dtype at load
    sampling           "triton": the argmax readout in two launches (`kernels.sample.argmax`), a
                       sampled readout without top-k / top-p in one (`kernels.sample.propose`);
                       "torch": torch's argmax and `epdraft.sampling`'s tensor ops
    side_stream        independent work runs on a second CUDA stream (`launch.Fork`): an MoE layer's
                       shared expert beside its router, dispatch and routed experts (its weights
                       stream while the router's small launches run; at hundreds of rows its
                       FLOP-bound GEMMs overlap the byte-bound experts), a commit's odd layers' K/V
                       beside the even ones'; on CUDA
    graphs             the step replays from CUDA graphs (`runtime.graphs`)

Adding a kernel family: docs/compute-kernels.md. The Triton paths have no backward: a draft
trained with autograd is built with `StepKernels.reference()`.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

import msgspec
import torch

from epdraft.config.ffn import DraftMoeFFNSpec
from epdraft.config.hf import DraftMixFFNSpec
from epdraft.dispatch import MoeLayout
from epdraft.errors import ConfigError
from epdraft.kernels.experts import fused
from epdraft.kernels.sample import propose
from epdraft.kernels.step import attention, ops, skinny

log = logging.getLogger(__name__)

# op -> (its kernel family's implementation, the torch fallback, the family's
# unsupported_reason(device_type, dtype)); adding a family is a field below and a line here
FAMILIES: dict[str, tuple[str, str, Callable[[str, torch.dtype], str | None]]] = {
    "step_ops": ("triton", "torch", ops.unsupported_reason),
    "projections": ("skinny", "torch", skinny.unsupported_reason),
    "attention": ("triton", "torch", attention.unsupported_reason),
    "experts": ("fused", "reference", fused.unsupported_reason),
    "sampling": ("triton", "torch", propose.unsupported_reason),
}


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The draft's dtype when none is asked for: bfloat16 on CUDA (the fused expert kernels' dtype),
    float32 elsewhere. The one default of the runner and `DraftRuntime.build`."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class StepKernels(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's resolved compute: which implementation runs each op of the draft step (module
    docstring). `reasons`: for each op on CUDA that runs its torch path, the family's own words for
    why (empty when every kernel runs, and on CPU); `dequantized`: why a quantized checkpoint's
    experts are dequantized at load, and that DeepSeek's fp8 linears are (None when nothing is)."""

    step_ops: Literal["triton", "torch"] = "torch"
    projections: Literal["skinny", "torch"] = "torch"
    attention: Literal["triton", "torch"] = "torch"
    experts: Literal["fused", "reference"] = "reference"
    quantized_experts: bool = False
    sampling: Literal["triton", "torch"] = "torch"
    side_stream: bool = False
    graphs: bool = False
    reasons: tuple[str, ...] = ()
    dequantized: str | None = None

    @classmethod
    def reference(cls) -> StepKernels:
        """Every op on its torch path: CPU, autograd, and the oracle the kernels are held against."""
        return cls()

    @classmethod
    def for_device(
        cls, device: torch.device | str | None, dtype: torch.dtype | None, *, ffn: DraftMixFFNSpec | None = None,
        layout: MoeLayout | None = None,
    ) -> StepKernels:
        """`resolve` for a module built on its own (tests, tools), whose device (default CPU) and dtype
        (default torch's) may be unset; no graphs. The runtime resolves one value per rank and hands it
        to every module instead."""
        device = device if device is not None else "cpu"
        return cls.resolve(device, dtype or torch.get_default_dtype(), ffn=ffn, layout=layout)

    @classmethod
    def resolve(
        cls,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        ffn: DraftMixFFNSpec | None = None,
        layout: MoeLayout | None = None,
        graphs: bool = False,
    ) -> StepKernels:
        """The fastest implementation of each op that can run on `device` in `dtype` for this draft.

        `ffn`: the draft's FFN spec (its quantization and MoE layers decide the experts' storage);
        `layout`: the rank's MoE layout (a moe_tp slice keeps no quantized experts; graphs need a
        capturable dispatch); `graphs`: `draft.cuda_graphs`.

        Raises ConfigError naming draft.cuda_graphs when graphs are asked for and the step cannot
        be captured here (CPU, a dispatch that syncs with the host, experts on the reference loop).
        """
        device_type = torch.device(device).type
        has_moe = ffn is not None and bool(ffn.moe_layers)
        why = {op: unsupported_reason(device_type, dtype) for op, (_, _, unsupported_reason) in FAMILIES.items()}
        tp_size = layout.tp_size if layout is not None else 1
        quantized_why = quantized_experts_reason(ffn, tp_size=tp_size, device_type=device_type, dtype=dtype)
        quantized_why = quantized_why or why["experts"]
        loaded: list[str] = []
        in_dtype = f"dequantized to {str(dtype).removeprefix('torch.')} at load"
        if (quantized := _quantized_layers(ffn)) and quantized_why is not None:
            q = quantized[0][1].quantization
            loaded.append(f"{'fp4' if q.expert_dtype == 'fp4' else q.method} checkpoint {in_dtype} ({quantized_why})")
        if ffn is not None and ffn.quantization is not None and ffn.quantization.expert_dtype == "fp4":
            loaded.append(f"fp8 linears {in_dtype}")  # DeepSeek's: always (the fp4 experts may stay quantized)
        dequantized = "; ".join(loaded) or None
        # on CUDA, an op on its torch path is worth a warning (a draft without MoE layers has no experts to run)
        shown = [f"{op}: {w}" for op, w in why.items() if w is not None and (op != "experts" or has_moe)]
        kernels = cls(
            **{op: slow if why[op] is not None else fast for op, (fast, slow, _) in FAMILIES.items()},
            quantized_experts=quantized_why is None,
            side_stream=device_type == "cuda",
            graphs=graphs,
            reasons=tuple(shown) if device_type == "cuda" else (),
            dequantized=dequantized,
        )
        if graphs:
            kernels._check_capturable(device_type, layout, why["experts"] if has_moe else None)
        return kernels

    def _check_capturable(self, device_type: str, layout: MoeLayout | None, experts_why: str | None) -> None:
        if device_type != "cuda":
            raise ConfigError("draft.cuda_graphs = true needs CUDA, and this rank's draft runs on the CPU")
        if layout is not None and not layout.capturable:
            raise ConfigError(
                f"draft.cuda_graphs = true: {layout.label} dispatch syncs with the host and cannot be captured; "
                "use draft.a2a_backend = 'torch_fixed' (or moe_layout gather / replicated, deepep with low_latency)"
            )
        if experts_why is not None:
            raise ConfigError(
                "draft.cuda_graphs = true: the routed experts run the per-expert reference loop, which syncs "
                f"with the host and cannot be captured ({experts_why})"
            )

    @property
    def label(self) -> str:
        """One line for the rank's log and the run summary: `step ops triton, projections skinny, ...`."""
        experts = self.experts + (" (quantized)" if self.quantized_experts else "")
        return (f"step ops {self.step_ops}, projections {self.projections}, attention {self.attention}, "
                f"experts {experts}, sampling {self.sampling}, graphs {'on' if self.graphs else 'off'}")  # fmt: skip


def _quantized_layers(ffn: DraftMixFFNSpec | None) -> list[tuple[int, DraftMoeFFNSpec]]:
    """(layer id, spec) of the MoE layers whose routed experts the checkpoint stores quantized."""
    if ffn is None:
        return []
    return [(i, s) for i, s in enumerate(ffn.layers) if isinstance(s, DraftMoeFFNSpec) and s.quantization is not None]


def quantized_experts_reason(
    ffn: DraftMixFFNSpec | None, *, tp_size: int, device_type: str, dtype: torch.dtype
) -> str | None:
    """Why the draft's quantized routed experts cannot stay quantized for the fused kernels (None:
    every such layer's can): held whole only (no moe_tp slice of the scale blocks), gate rows first
    (gpt-oss's interleaved gate/up rows are not), and what the kernels themselves take
    (`fused.quantized_unsupported_reason`). `epdraft check` asks it for CUDA on any host."""
    layers = _quantized_layers(ffn)
    if not layers:
        return "unquantized"
    if tp_size > 1:
        return f"draft.moe_tp = {tp_size} slices the experts; quantized experts are held whole"
    for i, layer in layers:
        if layer.activation.kind == "swigluoai":
            return "gpt-oss interleaves gate and up rows; quantized experts are held gate rows first"
        q = layer.quantization.experts
        why = fused.quantized_unsupported_reason(q.method, q.block, ffn.hidden_size, layer.intermediate_size,
                                                 device_type, dtype)  # fmt: skip
        if why is not None:
            return why if len(layers) == 1 else f"layer {i}: {why}"
    return None


def log_choice(kernels: StepKernels, level: int = logging.INFO) -> None:
    """Log the choice once per rank (beside the MoE layout's label), its label and a dequantized
    checkpoint's line at `level` (DEBUG on all but one rank keeps a default run's log short), and
    a warning for each op that runs its slow torch path on CUDA, at any level."""
    log.log(level, "draft step kernels: %s", kernels.label)
    for reason in kernels.reasons:
        log.warning("draft step kernels: %s", reason)
    if kernels.dequantized is not None:
        log.log(level, "%s", kernels.dequantized)
