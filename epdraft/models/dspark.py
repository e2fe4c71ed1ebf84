"""DSparkDraft: DFlash plus a low-rank Markov head over the previous token, and a confidence head.

Inside the block the readout is semi-autoregressive without another backbone pass:
    prev_0 = anchor;  logits_k = base_logits[:, k] + markov_w2(markov_w1(prev_k));  prev_{k+1} = argmax(logits_k)
with base_logits = lm_head(hidden of block rows 1..B-1) (SpecForge `dspark.py`, SGLang `models/dspark.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from epdraft.dispatch import Dispatcher
from epdraft.errors import ConfigError
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.spec import DraftModelSpec


def markov_logits(base_NV: torch.Tensor, prev_N: torch.Tensor, w1_Vr: torch.Tensor, w2_Vr: torch.Tensor) -> torch.Tensor:
    """Vanilla Markov head: base [N, V] + markov_w2(markov_w1(prev)) [N, V], in fp32."""
    return base_NV.float() + (w1_Vr[prev_N].float() @ w2_Vr.float().T)


class MarkovHead(nn.Module):
    """`markov_w1` = Embedding [V, r] of the previous token, `markov_w2` = Linear r -> V (no bias)."""

    def __init__(self, vocab_size: int, rank: int, *, dtype, device):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype, device=device)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False, dtype=dtype, device=device)

    def decode(self, base_NkV: torch.Tensor, anchors_N: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [N, k] token by token: each step's logits add the Markov term of the previous draft."""
        prev = anchors_N.to(base_NkV.device)
        drafts = []
        for k in range(base_NkV.shape[1]):
            prev = markov_logits(base_NkV[:, k], prev, self.markov_w1.weight, self.markov_w2.weight).argmax(dim=-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1) if drafts else base_NkV.new_zeros(base_NkV.shape[0], 0, dtype=torch.long)


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
    ):
        if spec.markov_head_type != "vanilla":
            raise ConfigError(
                f"markov_head_type = {spec.markov_head_type!r}: only the 'vanilla' DSpark Markov head is supported"
            )
        super().__init__(spec, dtype=dtype, device=device, dispatcher=dispatcher)
        self.markov_head = MarkovHead(spec.vocab_size, spec.markov_rank, dtype=dtype, device=device)
        self.confidence_head: ConfidenceHead | None = None
        if spec.enable_confidence_head:
            width = spec.hidden_size + (spec.markov_rank if spec.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width, device=device)

    def readout(self, hidden_NQH: torch.Tensor, anchors_N: torch.Tensor, heads: TargetHeads) -> torch.Tensor:
        return self.markov_head.decode(heads.lm_head(hidden_NQH), anchors_N)

    @torch.no_grad()
    def confidence(self, hidden_NkH: torch.Tensor, prev_Nk: torch.Tensor) -> torch.Tensor:
        """Predicted accept probability [N, k] of each draft row; prev_Nk = the token before each row.

        Raises ConfigError when the export has no confidence head.
        """
        if self.confidence_head is None:
            raise ConfigError("enable_confidence_head is false: this DSpark draft has no confidence head")
        inputs = hidden_NkH
        if self.spec.confidence_head_with_markov:
            inputs = torch.cat([hidden_NkH, self.markov_head.markov_w1(prev_Nk).to(hidden_NkH.dtype)], dim=-1)
        return self.confidence_head(inputs)
