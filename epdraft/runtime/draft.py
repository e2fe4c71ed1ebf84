"""DraftRuntime: what a serving engine embeds to run an MoE draft under DP attention + EP.

The engine builds one per DP rank (with its own process groups, or from a ParallelConfig), then on
every rank, every step, in the same order:

    proposal = runtime.propose(step, anchors)      # {} on an idle rank: it still joins every collective
    if proposal.plan.skip: ...                      # no rank had rows: every rank skipped together
    result = engine.verify(blocks built from proposal.drafts)
    runtime.commit(result)                          # committed rows' target features -> draft context

`propose` does the step's one sync (row counts, step id, the caller's extras) and then runs every
draft layer once over all of the rank's rows, handing the agreed plan to every MoE layer, so each
MoE collective is entered exactly once per layer per step by every rank.

Every rank's `Watchdog` beats through the rendezvous store (the runner passes its own; otherwise
`build` starts one over the coordinator's ranks and `close` stops it). When a step's collective
fails because a peer died, `propose` raises a ParallelError naming that peer, this rank's step
and phase, instead of torch's "Connection reset by peer", so an engine gets the runner's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from epdraft.config.parallel import DEFAULT_HANG_TIMEOUT_S, ParallelConfig
from epdraft.dispatch import MoeLayout, StepPlan, make_dispatcher
from epdraft.errors import EpdraftError, NonFiniteError, RequestError
from epdraft.layers.moe import DraftMoE
from epdraft.layers.routed_experts import reference_fallback_reason
from epdraft.models.cache import DraftCache
from epdraft.models.checkpoint import load_draft, read_draft_spec
from epdraft.models.dflash import TargetHeads
from epdraft.models.protocol import DraftModel
from epdraft.models.spec import DraftModelSpec
from epdraft.parallel.groups import Groups
from epdraft.parallel.watchdog import Watchdog
from epdraft.runtime.coordinator import StepCoordinator
from epdraft.runtime.timing import PhaseTimers, TimedDispatcher, time_forward
from epdraft.target.base import VerifyResult

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One step's drafts on this rank: drafts[request_id] = [B-1] int64 tokens; plan as agreed by all ranks."""

    plan: StepPlan
    drafts: dict[int, torch.Tensor]


class DraftRuntime:
    """One DP rank's draft: per-request context caches, the draft model, and the step's coordinator.

    Args:
        draft: the loaded draft, its MoE layers holding this rank's experts and talking through
            this rank's dispatcher.
        heads: the target's embedding and lm_head.
        coordinator: the per-step StepCoordinator over the draft's DP group.
        layout: the MoeLayout the draft was built with (what the run summary reports).
        timers: phase timers (None: no timing, no extra device syncs).
        watchdog: this rank's heartbeat (its step and phase are set here), which names the lost
            peer when a step's collective fails.
        owns_watchdog: whether `close` stops it (the runtime started it).
    """

    def __init__(
        self,
        draft: DraftModel,
        heads: TargetHeads,
        coordinator: StepCoordinator,
        layout: MoeLayout,
        *,
        watchdog: Watchdog,
        owns_watchdog: bool = False,
        timers: PhaseTimers | None = None,
    ):
        self.draft = draft
        self.heads = heads
        self.coordinator = coordinator
        self.layout = layout
        self.timers = timers
        self.watchdog = watchdog
        self._owns_watchdog = owns_watchdog
        self._caches: dict[int, DraftCache] = {}
        moe_layers = [m for m in draft.modules() if isinstance(m, DraftMoE)]
        self._dispatchers = {id(m.dispatcher): m.dispatcher for m in moe_layers}
        for m in moe_layers:
            # Names the layer a lost peer left this rank in (an attribute write: no sync, no store access).
            m.register_forward_pre_hook(
                lambda _m, _args, phase=f"draft layer {m.layer_id} MoE": watchdog.progress(phase=phase)
            )
            if timers is not None:
                time_forward(m, timers, "moe_total")

    @classmethod
    def build(
        cls,
        draft_path: str | Path,
        heads: TargetHeads,
        *,
        groups: Groups,
        layout: MoeLayout,
        spec: DraftModelSpec | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_extras: int = 0,
        timers: PhaseTimers | None = None,
        watchdog: Watchdog | None = None,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> DraftRuntime:
        """Load the draft at `draft_path` onto this rank as `layout` places it (the engine passes its groups).

        `spec`: the draft's spec when already read (its config.json is then not read again).
        `watchdog`: the rank's running watchdog; None: one is started over `groups.cpu`'s ranks
        (through the default group's store; a stalled peer is logged after `hang_timeout_s`)
        and stopped by `close`. Every rank of `groups.cpu` must build its runtime the same way.
        """
        spec = spec if spec is not None else read_draft_spec(draft_path)
        dispatcher = make_dispatcher(layout, groups.moe if layout.layout != "replicated" else None)
        if timers is not None:
            dispatcher = TimedDispatcher(dispatcher, timers)
        if spec.ffn.moe_layers and (why := reference_fallback_reason(device, dtype)) is not None:
            log.warning("%s", why)
        draft = load_draft(draft_path, spec=spec, dtype=dtype, device=device, dispatcher=dispatcher)
        coordinator = StepCoordinator(groups.cpu, num_extras=num_extras)
        log.info("draft MoE layout: %s", layout.label)
        owns = watchdog is None
        if watchdog is None:
            watchdog = Watchdog.start_for(groups.cpu, hang_timeout_s=hang_timeout_s, name="draft")
        return cls(draft, heads, coordinator, layout, watchdog=watchdog, owns_watchdog=owns, timers=timers)

    @classmethod
    def from_config(
        cls,
        pc: ParallelConfig,
        draft_path: str | Path,
        heads: TargetHeads,
        *,
        groups: Groups,
        spec: DraftModelSpec | None = None,
        **kwargs,
    ) -> DraftRuntime:
        """As `build`, with the layout resolved from a ParallelConfig's `draft` section (`auto` planned
        here) and a watchdog it starts bounded by its `cluster.hang_timeout_s`."""
        spec = spec if spec is not None else read_draft_spec(draft_path)
        layout = MoeLayout.resolve(pc, spec.ffn, groups)
        kwargs.setdefault("hang_timeout_s", pc.cluster.hang_timeout_s)
        return cls.build(draft_path, heads, groups=groups, layout=layout, spec=spec, **kwargs)

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
            self.draft.extend_contexts([cache], [prompt_features])
        self._caches[request_id] = cache

    def release(self, request_id: int) -> None:
        """Forget a finished request's context."""
        self._caches.pop(request_id, None)

    @torch.no_grad()
    def propose(self, step: int, anchors: Mapping[int, int], extras: tuple[int, ...] = ()) -> Proposal:
        """Sync, then draft B-1 tokens for every request in `anchors` (request id -> last verified token).

        Every rank must call this once per step, an idle rank with `anchors = {}`. Returns with
        empty drafts on every rank when the agreed plan says no rank has rows.

        Raises ParallelError naming the lost peer(s), this step and phase when a collective fails
        because a peer died or stalled; NonFiniteError naming the draft layer whose hidden states
        went NaN or inf.
        """
        missing = [r for r in anchors if r not in self._caches]
        if missing:
            raise RequestError(f"propose: requests {missing} were never added on this rank")
        try:
            self.watchdog.progress(step, "step sync")
            with self._phase("sync"):
                plan = self.coordinator.sync(step, len(anchors) * self.block_size, extras)
            if plan.skip:
                return Proposal(plan, {})
            self.watchdog.progress(phase="draft propose")
            ids = list(anchors)
            anchors_N = torch.tensor([anchors[r] for r in ids], dtype=torch.long, device=self.draft.device)
            with self._phase("draft_propose"):
                drafts_NB = self.draft.propose([self._caches[r] for r in ids], anchors_N, self.heads, plan)
        except NonFiniteError as e:
            raise self._failed(NonFiniteError(f"rank {self.coordinator.rank} at step {step}: {e}")) from None
        except EpdraftError:
            raise
        except RuntimeError as e:
            lost = self.watchdog.lost_error(e, what=f"step {step}'s draft collectives")
            if lost is None:
                raise
            raise self._failed(lost) from e
        return Proposal(plan, {r: drafts_NB[i] for i, r in enumerate(ids)})

    def _failed(self, error: EpdraftError) -> EpdraftError:
        """Tell the peers why this rank fails (they name it rather than calling it gone); return `error`."""
        self.watchdog.fail(str(error))
        return error

    @torch.no_grad()
    def commit(self, result: VerifyResult) -> None:
        """Append each verified request's committed rows (anchor + accepted drafts) to its context."""
        with self._phase("draft_context"):
            self.draft.extend_contexts(
                [self._caches[rid] for rid in result.request_ids],
                [result.features[result.rows(i)] for i in range(len(result.request_ids))],
            )

    def close(self) -> None:
        """Free the dispatcher's buffers (every rank of the MoE group must call it) and stop the
        watchdog the runtime started (before the engine leaves the world)."""
        for dispatcher in self._dispatchers.values():
            dispatcher.close()
        if self._owns_watchdog:
            self.watchdog.stop()
