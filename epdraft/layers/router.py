"""Router module: holds the gate weight (and bias) in fp32 and calls the pure routing math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdraft.config.ffn import RouterSpec
from epdraft.errors import ConfigError
from epdraft.kernels.step.ops import Selection, router_kernel_takes, router_topk, topk_route
from epdraft.layers.routing import hash_route, route
from epdraft.layers.step_kernels import StepKernels


class Router(nn.Module):
    """Top-k router of one MoE layer.

    Parameters are fp32 whatever the model dtype (`weight [E, H]`, `bias [E]` when
    `spec.bias != "none"`): the logits are computed in fp32 so every rank and every
    implementation picks the same experts on near-ties. With the Triton step ops the logits,
    selection and weights are 2 launches where `router_kernel_takes` the shape (up to
    `ROUTER_KERNEL_MAX_ROWS` rows, any rows for a narrow router: `epdraft.kernels.step.ops.
    router_topk`; one where its routing fits the logits launch) where x's fp32 cast, cuBLAS's fp32
    GEMM, its split-K reduce and the top-k launch made 4 (5 with a logit bias's add); elsewhere
    cuBLAS's fp32 logits go into `topk_route`. Group-limited and hash routing keep the torch chain,
    which stays the reference of those launches. A hash-routed router also holds
    `tid2eid [vocab, K]` int64 (the experts of each token id; a parameter so the loader fills it).
    """

    def __init__(
        self,
        spec: RouterSpec,
        hidden_size: int,
        *,
        device: torch.device | str | None = None,
        kernels: StepKernels | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        kernels = kernels if kernels is not None else StepKernels.for_device(device, torch.float32)
        # the launches' selection covers plain and biased top-k; group-limited and hash routing keep the chain
        self.launches = kernels.step_ops == "triton" and not spec.group_limited and not spec.hash_routed
        self.weight = nn.Parameter(
            torch.empty(spec.num_experts, hidden_size, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if spec.bias != "none":
            bias_E = torch.zeros(spec.num_experts, dtype=torch.float32, device=device)
            self.bias = nn.Parameter(bias_E, requires_grad=False)
        self.tid2eid: nn.Parameter | None = None
        if spec.hash_routed:
            table_VK = torch.zeros(spec.vocab_size, spec.top_k, dtype=torch.long, device=device)
            self.tid2eid = nn.Parameter(table_VK, requires_grad=False)

    def forward(self, x_TH: torch.Tensor, input_ids_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x_TH: [T, H] hidden states in any float dtype; T may be 0.
            input_ids_T: [T] int64 token ids of the rows; required by (only used by) a hash-routed router.
        Returns:
            (ids_TK int64 global expert ids, weights_TK fp32 final combine weights).
        Raises:
            ConfigError: a hash-routed router called without the token ids.
        """
        s = self.spec
        selection_bias = self.bias if s.bias == "selection" else None
        if self.launches:
            selection = Selection(s.top_k, s.scoring, selection_bias, s.norm_topk_prob, s.renorm_eps,
                                  s.routed_scaling_factor, self.bias if s.bias == "logit" else None)  # fmt: skip
            if router_kernel_takes(x_TH.shape[0], s.num_experts):
                return router_topk(x_TH, self.weight, selection)
            return topk_route(F.linear(x_TH.float(), self.weight.float()), selection)
        logits_TE = F.linear(x_TH.float(), self.weight.float())
        if s.bias == "logit":
            logits_TE = logits_TE + self.bias
        if self.tid2eid is not None:
            if input_ids_T is None or input_ids_T.shape != x_TH.shape[:1]:
                got = None if input_ids_T is None else list(input_ids_T.shape)
                raise ConfigError(f"hash-routed router: needs input_ids_T [{x_TH.shape[0]}], got {got}")
            return hash_route(logits_TE, self.tid2eid[input_ids_T.to(self.tid2eid.device)], self.spec)
        return route(logits_TE, self.spec, selection_bias)

    def extra_repr(self) -> str:
        s = self.spec
        return f"E={s.num_experts}, K={s.top_k}, scoring={s.scoring}, bias={s.bias}" + (", hash" if s.hash_routed else "")
