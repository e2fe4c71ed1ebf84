"""DraftRuntime: what a serving engine embeds to run an MoE draft under DP attention + EP.

The engine builds one per DP rank (with its own process groups, or from a ParallelConfig), then on
every rank, every step, in the same order:

    proposal = runtime.propose(step, anchors)      # {} on an idle rank: it still joins every collective
    if proposal.plan.skip: ...                      # no rank had rows: every rank skipped together
    result = engine.verify(blocks built from proposal.drafts)
    runtime.commit(result)                          # committed rows' target features -> draft context

`propose` does the step's one sync (row counts, step id, the caller's extras) and then runs every
draft layer once over all of the rank's rows, so each MoE collective is entered exactly once per
layer per step by every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from epdraft.config.parallel import ParallelConfig
from epdraft.dispatch import make_dispatcher
from epdraft.dispatch.plan import StepPlan
from epdraft.dispatch.planner import choose_for_config
from epdraft.errors import ConfigError, RequestError
from epdraft.layers.moe import DraftMoE
from epdraft.layers.moe_context import MoeContext
from epdraft.models.cache import DraftCache
from epdraft.models.checkpoint import load_draft
from epdraft.models.dflash import DFlashDraft, TargetHeads
from epdraft.models.spec import DraftModelSpec
from epdraft.target.base import VerifyResult
from epdraft.worker.dp_sync import StepSync
from epdraft.worker.groups import Groups
from epdraft.worker.timing import PhaseTimers, TimedDispatcher, time_forward

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One step's drafts on this rank: drafts[request_id] = [B-1] int64 tokens; plan as agreed by all ranks."""

    plan: StepPlan
    drafts: dict[int, torch.Tensor]


def draft_spec(draft_path: str | Path) -> DraftModelSpec:
    """The DraftModelSpec of a draft export directory (its config.json)."""
    from epdraft.config.hf import read_config_json

    return DraftModelSpec.from_config(read_config_json(draft_path), source=str(Path(draft_path) / "config.json"))


def resolve_layout(pc: ParallelConfig, draft_path: str | Path) -> tuple[str, str, str | None]:
    """(moe_layout, dp_padding, why) as the config asks, `auto` resolved by the planner (why: its reason)."""
    d = pc.draft
    if d.moe_layout != "auto":
        return d.moe_layout, d.dp_padding, None
    choice = choose_for_config(pc, draft_spec(draft_path).ffn)
    return choice.layout, choice.dp_padding, choice.reason


class DraftRuntime:
    """One DP rank's draft: per-request context caches, the draft model, and the step's sync.

    Args:
        draft: the loaded draft, its DraftMoE layers holding this rank's experts and talking
            through this rank's dispatcher.
        heads: the target's embedding and lm_head.
        sync: the per-step StepSync over the draft's DP group.
        timers: phase timers (None: no timing, no extra device syncs).
    """

    def __init__(self, draft: DFlashDraft, heads: TargetHeads, sync: StepSync, *, timers: PhaseTimers | None = None):
        self.draft = draft
        self.heads = heads
        self.sync = sync
        self.timers = timers
        self._caches: dict[int, DraftCache] = {}
        self._moe_ctx = next((m.ctx for m in draft.modules() if isinstance(m, DraftMoE)), None)
        if timers is not None:
            for m in draft.modules():
                if isinstance(m, DraftMoE):
                    time_forward(m, timers, "moe_total")

    @classmethod
    def build(
        cls,
        draft_path: str | Path,
        heads: TargetHeads,
        *,
        groups: Groups,
        moe_layout: str,
        a2a_backend: str = "torch",
        dp_padding: str = "max_len",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_extras: int = 0,
        timers: PhaseTimers | None = None,
    ) -> "DraftRuntime":
        """Load the draft at `draft_path` onto this rank with the given layout (the engine passes its groups).

        `moe_layout` must be resolved ("auto" is resolved by `from_config`, which knows the links).
        """
        if moe_layout == "auto":
            raise ConfigError("DraftRuntime.build: resolve draft.moe_layout = 'auto' first (from_config does)")
        spec = draft_spec(draft_path)
        moe = spec.ffn.layers[spec.ffn.moe_layers[0]] if spec.ffn.moe_layers else None
        dispatcher = make_dispatcher(
            moe_layout if moe is not None else "replicated",
            a2a_backend,
            groups.moe,
            moe.num_experts if moe is not None else 1,
            spec.hidden_size,
            ep_size=groups.ep_size,
            tp_size=groups.tp_size,
            dp_padding=dp_padding,
            top_k=moe.top_k if moe is not None else 0,
        )
        if timers is not None:
            dispatcher = TimedDispatcher(dispatcher, timers)
        # Replicated: every rank holds every expert whatever the groups' ep x tp (auto may pick it on
        # an EP config); the other layouts place this rank's expert shard by its group coordinates.
        ctx = MoeContext(dispatcher=dispatcher) if moe_layout == "replicated" else groups.moe_context(dispatcher)
        draft = load_draft(draft_path, dtype=dtype, device=device, moe_context=ctx)
        sync = StepSync(groups.cpu, num_extras=num_extras)
        return cls(draft, heads, sync, timers=timers)

    @classmethod
    def from_config(
        cls, pc: ParallelConfig, draft_path: str | Path, heads: TargetHeads, *, groups: Groups, **kwargs
    ) -> "DraftRuntime":
        """As `build`, with the layout read from a ParallelConfig's `draft` section."""
        layout, padding, why = resolve_layout(pc, draft_path)
        if why is not None:
            log.info("draft.moe_layout = 'auto' -> %s", why)
        return cls.build(
            draft_path,
            heads,
            groups=groups,
            moe_layout=layout,
            a2a_backend=pc.draft.a2a_backend,
            dp_padding=padding,
            **kwargs,
        )

    @property
    def spec(self) -> DraftModelSpec:
        return self.draft.spec

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    def _phase(self, name: str):
        return self.timers.phase(name) if self.timers is not None else contextlib.nullcontext()

    def add_request(self, request_id: int, prompt_features: torch.Tensor) -> None:
        """Start a request's draft context from its prompt rows' target features [L, K*H]."""
        if request_id in self._caches:
            raise RequestError(f"request {request_id} is already active on this rank")
        cache = self.draft.new_cache()
        with self._phase("draft_context"):
            self.draft.extend_context(cache, prompt_features)
        self._caches[request_id] = cache

    def release(self, request_id: int) -> None:
        """Forget a finished request's context."""
        self._caches.pop(request_id, None)

    @torch.no_grad()
    def propose(self, step: int, anchors: Mapping[int, int], extras: tuple[int, ...] = ()) -> Proposal:
        """Sync, then draft B-1 tokens for every request in `anchors` (request id -> last verified token).

        Every rank must call this once per step, an idle rank with `anchors = {}`. Returns with
        empty drafts on every rank when the agreed plan says no rank has rows.
        """
        missing = [r for r in anchors if r not in self._caches]
        if missing:
            raise RequestError(f"propose: requests {missing} were never added on this rank")
        with self._phase("sync"):
            plan = self.sync.sync(step, len(anchors) * self.block_size, extras)
        if plan.skip:
            return Proposal(plan, {})
        if self._moe_ctx is not None:
            self._moe_ctx.begin_step(plan)
        ids = list(anchors)
        device = self.draft.fc.weight.device
        anchors_N = torch.tensor([anchors[r] for r in ids], dtype=torch.long, device=device)
        with self._phase("draft_propose"):
            drafts_NB = self.draft.propose([self._caches[r] for r in ids], anchors_N, self.heads)
        return Proposal(plan, {r: drafts_NB[i] for i, r in enumerate(ids)})

    @torch.no_grad()
    def commit(self, result: VerifyResult) -> None:
        """Append each verified request's committed rows (anchor + accepted drafts) to its context."""
        with self._phase("draft_context"):
            self.draft.extend_contexts(
                [self._caches[rid] for rid in result.request_ids],
                [result.features[result.rows(i)] for i in range(len(result.request_ids))],
            )

    def close(self) -> None:
        """Free the dispatcher's buffers."""
        if self._moe_ctx is not None:
            self._moe_ctx.dispatcher.close()

