"""DSparkDraft: DFlash plus a low-rank Markov head over the previous token, and a confidence head.

Inside the block the readout is semi-autoregressive without another backbone pass: with
base_k = lm_head(h_k), h_k the hidden row that drafts token k+1 and prev_0 = the anchor,
    logits_k = base_k + markov_w2(latent_k);  prev_{k+1} = argmax(logits_k)
where latent_k depends on the head type (SpecForge `dspark_heads.py`, SGLang `models/dspark.py`):
    vanilla: e_k = markov_w1(prev_k)
    gated:   sigmoid(gate_proj([h_k, e_k])) * e_k
    rnn:     g, c, o = joint_proj([s_k, e_k, h_k]);  s_{k+1} = sig(g) s_k + (1 - sig(g)) tanh(c);  tanh(o)
             with s_0 = 0.
Math runs in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdraft.dispatch import Dispatcher
from epdraft.errors import ConfigError
from epdraft.kernels.sample import markov_argmax as markov_argmax_launch
from epdraft.layers.step_kernels import StepKernels
from epdraft.models.dflash import DFlashDraft, SampledReadout, TargetHeads
from epdraft.sampling import propose_tokens
from epdraft.models.spec import DraftModelSpec


def gated_latent(e_Nr: torch.Tensor, h_NH: torch.Tensor, w_rX: torch.Tensor, b_r: torch.Tensor) -> torch.Tensor:
    """Gated head: sigmoid(W [h, e] + b) * e, W = gate_proj.weight [r, H + r] (hidden columns first)."""
    return torch.sigmoid(F.linear(torch.cat([h_NH, e_Nr], dim=-1), w_rX, b_r)) * e_Nr


def rnn_step(
    s_Nr: torch.Tensor, e_Nr: torch.Tensor, h_NH: torch.Tensor, w_3rX: torch.Tensor, b_3r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the rnn head: (next state [N, r], latent [N, r]); W = joint_proj.weight [3r, 2r + H]."""
    gate, candidate, output = F.linear(torch.cat([s_Nr, e_Nr, h_NH], dim=-1), w_3rX, b_3r).chunk(3, dim=-1)
    gate = torch.sigmoid(gate)
    return gate * s_Nr + (1.0 - gate) * torch.tanh(candidate), torch.tanh(output)


class MarkovHead(nn.Module):
    """`markov_w1` = Embedding [V, r] of the previous token, `markov_w2` = Linear r -> V (no bias);
    the gated head adds `gate_proj` Linear(H + r -> r), the rnn head `joint_proj` Linear(2r + H -> 3r).
    `fused_readout` (`StepKernels.sampling` is "triton"): sampled drafts are drawn in one launch per
    position (`kernels.sample.propose`), greedy ones by two up to `markov_argmax.MAX_ROWS` rows
    (`kernels.sample.markov_argmax`)."""

    def __init__(
        self, kind: str, vocab_size: int, rank: int, hidden_size: int, *, dtype, device, fused_readout: bool = False
    ):
        super().__init__()
        self.kind = kind
        self.fused_readout = fused_readout
        kw = dict(dtype=dtype, device=device)
        self.markov_w1 = nn.Embedding(vocab_size, rank, **kw)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False, **kw)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank, **kw)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, **kw)

    def decode(
        self,
        base_NkV: torch.Tensor,
        hidden_NkH: torch.Tensor,
        anchors_N: torch.Tensor,
        sampling: SampledReadout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [N, k], q [N, k, V] fp32 or None): each step's logits [N, V] add the bias of the
        previous token (and hidden row); the draft is their argmax, or with `sampling` a sample of
        their processed distribution, which is then q of that position given the drafts before it."""
        N, k = base_NkV.shape[:2]
        prev = anchors_N.to(base_NkV.device)
        greedy_launch = sampling is None and self.fused_readout and N <= markov_argmax_launch.MAX_ROWS
        w2 = self.markov_w2.weight if greedy_launch else self.markov_w2.weight.float()
        state = base_NkV.new_zeros(N, self.markov_w1.embedding_dim, dtype=torch.float32)
        drafts, probs = [], []
        for i in range(k):
            e, h = self.markov_w1(prev).float(), hidden_NkH[:, i].float()
            if self.kind == "gated":
                latent = gated_latent(e, h, self.gate_proj.weight.float(), self.gate_proj.bias.float())
            elif self.kind == "rnn":
                state, latent = rnn_step(state, e, h, self.joint_proj.weight.float(), self.joint_proj.bias.float())
            else:
                latent = e
            if greedy_launch:  # the logits are never materialized
                prev = markov_argmax_launch.markov_argmax(base_NkV[:, i], latent, w2)
            elif sampling is None:
                prev = (base_NkV[:, i].float() + latent @ w2.T).argmax(dim=-1)
            else:
                logits_N1V = (base_NkV[:, i].float() + latent @ w2.T).unsqueeze(1)
                tokens_N1, q_N1V = propose_tokens(logits_N1V, sampling.batch, sampling.first_N + i,
                                                  fused=self.fused_readout)  # fmt: skip
                prev = tokens_N1[:, 0]
                probs.append(q_N1V)
            drafts.append(prev)
        drafts_Nk = torch.stack(drafts, dim=1) if drafts else base_NkV.new_zeros(N, 0, dtype=torch.long)
        if sampling is None:
            return drafts_Nk, None
        return drafts_Nk, torch.cat(probs, dim=1) if probs else base_NkV.new_zeros(N, 0, base_NkV.shape[-1])


class ConfidenceHead(nn.Module):
    """SpecForge AcceptRatePredictor: sigmoid(proj(hidden [++ markov_w1(prev)])), fp32 Linear(H [+ r], 1)."""

    def __init__(self, in_features: int, *, device):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, dtype=torch.float32, device=device)

    def forward(self, inputs_NkX: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(inputs_NkX.float())).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """DFlash backbone + `markov_head.*` (+ `confidence_head.proj.*` when `enable_confidence_head`)."""

    def __init__(
        self,
        spec: DraftModelSpec,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        dispatcher: Dispatcher | None = None,
        kernels: StepKernels | None = None,
    ):
        super().__init__(spec, dtype=dtype, device=device, dispatcher=dispatcher, kernels=kernels)
        self.markov_head = MarkovHead(
            spec.markov_head_type, spec.vocab_size, spec.markov_rank, spec.hidden_size, dtype=dtype, device=device,
            fused_readout=self.kernels.sampling == "triton",
        )  # fmt: skip
        self.confidence_head: ConfidenceHead | None = None
        if spec.enable_confidence_head:
            width = spec.hidden_size + (spec.markov_rank if spec.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width, device=device)

    def read_out(
        self,
        hidden_NkH: torch.Tensor,
        anchors_N: torch.Tensor,
        heads: TargetHeads,
        sampling: SampledReadout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(drafts [N, k] from the Markov head's decode (argmax, or sampled with `sampling`), each
        draft's confidence [N, k] fp32 when the export has a confidence head, else None, q or None):
        the confidence is read from the same hidden row as the draft, with the token before it
        (the anchor for the first)."""
        drafts, probs = self.markov_head.decode(heads.lm_head(hidden_NkH), hidden_NkH, anchors_N, sampling)
        if self.confidence_head is None:
            return drafts, None, probs
        prev = torch.cat([anchors_N.to(drafts.device).unsqueeze(1), drafts[:, :-1]], dim=1)
        return drafts, self.confidence(hidden_NkH, prev), probs

    @torch.no_grad()
    def confidence(self, hidden_NkH: torch.Tensor, prev_Nk: torch.Tensor) -> torch.Tensor:
        """Predicted accept probability [N, k] of each draft row; prev_Nk = the token before each row's draft.

        Raises ConfigError when the export has no confidence head.
        """
        if self.confidence_head is None:
            raise ConfigError("enable_confidence_head is false: this DSpark draft has no confidence head")
        inputs = hidden_NkH
        if self.spec.confidence_head_with_markov:
            inputs = torch.cat([hidden_NkH, self.markov_head.markov_w1(prev_Nk).to(hidden_NkH.dtype)], dim=-1)
        return self.confidence_head(inputs)
