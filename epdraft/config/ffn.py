"""Draft FFN specs: what one layer's FFN computes, independent of where its weights come from.

The per-model list of them, `DraftMixFFNSpec`, lives in `epdraft.config.hf` with the parser that
builds it from config.json: this module is below the parser (which builds these specs), so it
never imports it. Specs are frozen: safe to share between ranks and modules; derived values are
properties.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from epdraft.errors import ConfigError
from epdraft.config.quant import QuantSpec

ScoringFunc = Literal["softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"]
"""`softmax_topk` is gpt-oss: softmax over the k selected logits only (no renorm, no scale)."""

RouterBias = Literal["none", "selection", "logit"]
"""`selection`: DeepSeek noaux_tc bias, shifts which experts are chosen, never the weights.
`logit`: a bias added to the router logits before scoring (folded centering, gpt-oss)."""


class ActivationSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The gated activation between the up and down projections.

    `swiglu`: silu(gate) * up, with `limit > 0` clamping gate to <= limit and up to [-limit, limit].
    `swigluoai`: gpt-oss, (up + 1) * gate * sigmoid(alpha * gate) after the same clamps.
    """

    kind: Literal["swiglu", "swigluoai"] = "swiglu"
    limit: Annotated[float, msgspec.Meta(ge=0.0, description="clamp; 0 = off")] = 0.0
    alpha: Annotated[float, msgspec.Meta(gt=0.0, description="swigluoai sigmoid slope")] = 1.702


class RouterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Top-k routing: fp32 logits -> scores -> (biased, group-limited) selection -> weights.

    `hash_routed` (DeepSeek-V4's first `num_hash_layers` layers): the experts are `tid2eid[token id]`
    (an int64 table [vocab_size, top_k]) instead of a selection; the weights still come from the
    scores of those experts, renormalized and scaled as for a top-k layer.
    """

    num_experts: Annotated[int, msgspec.Meta(ge=1)]
    top_k: Annotated[int, msgspec.Meta(ge=1)]
    scoring: ScoringFunc = "softmax"
    norm_topk_prob: bool = True
    renorm_eps: Annotated[float, msgspec.Meta(ge=0.0, description="added to the top-k sum")] = 0.0
    routed_scaling_factor: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    n_group: Annotated[int, msgspec.Meta(ge=1)] = 1
    topk_group: Annotated[int, msgspec.Meta(ge=1)] = 1
    bias: RouterBias = "none"
    hash_routed: bool = False
    vocab_size: Annotated[int, msgspec.Meta(ge=0, description="rows of tid2eid (hash-routed layers)")] = 0

    def __post_init__(self) -> None:
        if self.hash_routed and (self.vocab_size < 1 or self.bias == "selection" or self.scoring == "softmax_topk"):
            raise ConfigError(
                f"hash-routed router: needs vocab_size >= 1 (got {self.vocab_size}), no selection bias "
                f"(got {self.bias!r}) and scores per expert (got scoring {self.scoring!r})"
            )

    @property
    def group_limited(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group


class DraftDenseFFNSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="dense"):
    """A dense gated MLP: down(act(gate x, up x))."""

    intermediate_size: Annotated[int, msgspec.Meta(ge=1)]
    activation: ActivationSpec = ActivationSpec()
    bias: bool = False


class DraftMoeFFNSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="moe"):
    """Routed experts (+ an optional shared expert, optionally sigmoid-gated).

    `expert_bias`: gpt-oss experts carry `gate_up_proj_bias [E, 2I]` and `down_proj_bias [E, H]`.
    `shared_intermediate_size` 0 means no shared expert.
    `quantization`: how the checkpoint stores this layer's routed experts (None: unquantized, or
    their module is in `modules_to_not_convert`).
    """

    router: RouterSpec
    intermediate_size: Annotated[int, msgspec.Meta(ge=1, description="per-expert intermediate size I")]
    activation: ActivationSpec = ActivationSpec()
    expert_bias: bool = False
    shared_intermediate_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    shared_gate: bool = False
    quantization: QuantSpec | None = None

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def expert_bytes(self, hidden_size: int, itemsize: int = 2) -> int:
        """Bytes of all routed experts' weights (gate, up, down) of this layer."""
        return self.num_experts * 3 * self.intermediate_size * hidden_size * itemsize


FFNSpec = Union[DraftDenseFFNSpec, DraftMoeFFNSpec]
