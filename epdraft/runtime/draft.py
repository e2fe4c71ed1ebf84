"""DraftRuntime: what a serving engine embeds to run an MoE draft under DP attention + EP.

The engine builds one per DP rank (with its own process groups, or from a ParallelConfig), then on
every rank, every step, in the same order:

    proposal = runtime.propose(step, anchors, counts=rows_per_rank)   # {} on an idle rank: it still
                                                    # joins every collective
    if proposal.plan.skip: ...                      # no rank had rows: every rank skipped together
    result = engine.verify(blocks built from proposal.drafts)
    runtime.commit(result)                          # committed rows' target features -> draft context

`counts` is the engine's DP metadata, already agreed for its target forward: every DP rank's rows
(requests x block_size), in the draft DP group's order. Given it, the step issues no collective
but its MoE layers' dispatch and combine. Without it, `propose` does one sync first (row counts,
step id -- checked --, the caller's extras), as the standalone runner does. Either way every draft
layer runs once over all of the rank's rows with the agreed plan handed to every MoE layer, so
each MoE collective is entered exactly once per layer per step by every rank.

Context K/V live in the draft's pool (a KVPool, or a WindowKVPool) sized once (`max_requests` x
`max_context` rows), written in place by `add_request` / `commit`; with `kernels.graphs` the step
and the commit are each replayed from a CUDA graph per batch bucket (`epdraft.runtime.graphs`), and
neither waits for the device: the pool's bookkeeping stays on the host, and the step's finite flags
are copied back asynchronously and checked by a later `commit` once they have arrived. Which kernel runs each op of the step is resolved once, in
`build` (`StepKernels`), logged beside the MoE layout and reported in the run summary.

Every rank's `Watchdog` beats through the rendezvous store (the runner passes its own; otherwise
`build` starts one over the coordinator's ranks and `close` stops it). When a step's collective
fails because a peer died, `propose` raises a ParallelError naming that peer, this rank's step
and phase, instead of torch's "Connection reset by peer", so an engine gets the runner's error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from epdraft.config.parallel import DEFAULT_HANG_TIMEOUT_S, ParallelConfig
from epdraft.config.sampling import SamplingParams
from epdraft.dispatch import MoeLayout, StepPlan, make_dispatcher
from epdraft.errors import ConfigError, EpdraftError, NonFiniteError, ParallelError, RequestError
from epdraft.kernels import launch
from epdraft.layers.moe import DraftMoE
from epdraft.layers.step_kernels import StepKernels, default_dtype, log_choice
from epdraft.models.checkpoint import load_draft, read_draft_spec
from epdraft.models.dflash import TargetHeads, check_finite
from epdraft.models.protocol import DraftModel
from epdraft.models.spec import DraftModelSpec
from epdraft.parallel.groups import Groups
from epdraft.parallel.watchdog import Watchdog
from epdraft.runtime.coordinator import StepCoordinator
from epdraft.runtime.graphs import CommitGraphs, StepGraphs, default_buckets
from epdraft.runtime.timing import PhaseTimers, TimedDispatcher, time_forward
from epdraft.sampling import Readout, seeded
from epdraft.target.base import VerifyResult

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One step's drafts on this rank: drafts[request_id] = [num_drafts] int64 tokens; plan as agreed
    by all ranks; confidence[request_id] = [num_drafts] fp32, each draft's predicted accept
    probability, from a DSpark draft's confidence head (empty for drafts without one);
    probs[request_id] = [num_drafts, V] fp32, the proposal distribution each draft was sampled
    from, for every request of a step in which any request samples (empty when all are greedy:
    the verifier then takes the argmax rule). All on the draft's device."""

    plan: StepPlan
    drafts: dict[int, torch.Tensor]
    confidence: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    probs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class DraftRuntime:
    """One DP rank's draft: the requests' context in a KV pool, the draft model, and the step's coordinator.

    Args:
        draft: the loaded draft, its MoE layers holding this rank's experts and talking through
            this rank's dispatcher.
        heads: the target's embedding and lm_head.
        coordinator: the per-step StepCoordinator over the draft's DP group.
        layout: the MoeLayout the draft was built with (what the run summary reports).
        max_requests / max_context: the KV pool's limits (requests at once, context rows each).
        timers: phase timers (None: no timing). Eager, the step is split into its MoE layers'
            dispatch, combine and the rest of each layer (nested phases, booked exclusively); under
            CUDA graphs the step is one phase ("draft_step_graph"): a replay has no host-side
            boundaries to time.
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
        max_requests: int,
        max_context: int,
        timers: PhaseTimers | None = None,
        watchdog: Watchdog,
        owns_watchdog: bool = False,
    ):
        self.draft = draft
        self.heads = heads
        self.coordinator = coordinator
        self.layout = layout
        self.kernels: StepKernels = draft.kernels
        self.timers = timers
        self.watchdog = watchdog
        self._owns_watchdog = owns_watchdog
        self.pool = draft.new_pool(max_requests=max_requests, max_context=max_context)
        # (step, its per-layer finite flags (host), the event after which they are there; None: on the CPU)
        self._flags: collections.deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = collections.deque()
        moe_layers = [m for m in draft.modules() if isinstance(m, DraftMoE)]
        self._dispatchers = {id(m.dispatcher): m.dispatcher for m in moe_layers}
        for m in moe_layers:
            # Names the layer a lost peer left this rank in (an attribute write: no sync, no store access).
            m.register_forward_pre_hook(
                lambda _m, _args, phase=f"draft layer {m.layer_id} MoE": watchdog.progress(phase=phase)
            )
        self.graphs: StepGraphs | None = None
        self.commit_graphs: CommitGraphs | None = None
        if self.kernels.graphs:
            spec = draft.spec
            self.commit_graphs = CommitGraphs(
                lambda slots_N, counts_N, rows_TF: draft.write_context(self.pool, slots_N, counts_N, rows_TF),
                pad_slot=self.pool.pad_slot, buckets=default_buckets(max_requests),
                rows_per_request=draft.num_drafts + 1, width=spec.num_target_features * spec.hidden_size,
                dtype=self.pool.dtype, device=draft.device,
            )  # fmt: skip
            self.graphs = StepGraphs(
                lambda slots, anchors, plan, readout: draft.step(
                    self.pool, slots, anchors, heads, plan, readout=readout
                ),
                pad_slot=self.pool.pad_slot, buckets=default_buckets(max_requests), block_size=draft.block_size,
                device=draft.device, capture_on_first_use=layout.layout == "replicated",
            )  # fmt: skip
        elif timers is not None:
            for m in moe_layers:
                time_forward(m, timers, "moe_experts")

    @classmethod
    def build(
        cls,
        draft_path: str | Path,
        heads: TargetHeads,
        *,
        groups: Groups,
        layout: MoeLayout,
        max_requests: int,
        max_context: int,
        spec: DraftModelSpec | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        graphs: bool = False,
        num_extras: int = 0,
        timers: PhaseTimers | None = None,
        watchdog: Watchdog | None = None,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> DraftRuntime:
        """Load the draft at `draft_path` onto this rank as `layout` places it (the engine passes its groups).

        max_requests / max_context size the KV pool (`draft.max_requests`, `draft.max_context`);
        `dtype`: the draft's (None: `default_dtype(device)`); `graphs` (`draft.cuda_graphs`) turns
        the captured step on. Which kernels run is resolved here, once (`StepKernels.resolve`:
        ConfigError when graphs cannot be captured here). `spec`: the draft's spec when already
        read (its config.json is then not read again). `watchdog`: the rank's running watchdog;
        None: one is started over `groups.cpu`'s ranks (through the default group's store; a
        stalled peer is logged after `hang_timeout_s`) and stopped by `close`. Every rank of
        `groups.cpu` must build its runtime the same way.
        """
        spec = spec if spec is not None else read_draft_spec(draft_path)
        dtype = dtype if dtype is not None else default_dtype(device)
        kernels = StepKernels.resolve(device, dtype, ffn=spec.ffn, layout=layout, graphs=graphs)
        _check_row_cap(layout, max_requests, spec.block_size, kernels.graphs)
        dispatcher = make_dispatcher(layout, groups.moe if layout.layout != "replicated" else None)
        if timers is not None and not kernels.graphs:
            dispatcher = TimedDispatcher(dispatcher, timers)
        # A fact of every rank alike: said once, by the group's first rank (the others at DEBUG).
        level = logging.INFO if dist.get_rank(groups.cpu) == 0 else logging.DEBUG
        log.log(level, "draft MoE layout: %s", layout.label)
        log_choice(kernels, level)
        draft = load_draft(draft_path, spec=spec, dtype=dtype, device=device, dispatcher=dispatcher, kernels=kernels)
        coordinator = StepCoordinator.for_groups(groups, num_extras=num_extras)
        owns = watchdog is None
        if watchdog is None:
            watchdog = Watchdog.start_for(groups.cpu, hang_timeout_s=hang_timeout_s, name="draft")
        return cls(
            draft, heads, coordinator, layout, max_requests=max_requests, max_context=max_context,
            timers=timers, watchdog=watchdog, owns_watchdog=owns,
        )  # fmt: skip

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
        """As `build`, with the layout resolved from a ParallelConfig's `draft` section (`auto` planned here),
        graphs from `draft.cuda_graphs`, the KV pool sized by `draft.max_requests` /
        `draft.max_context` unless given, and a watchdog it starts bounded by `cluster.hang_timeout_s`.

        Raises ConfigError naming the key when neither the config nor the caller sizes the pool.
        """
        for key in ("max_requests", "max_context"):
            kwargs.setdefault(key, getattr(pc.draft, key))
            if kwargs[key] < 1:
                raise ConfigError(
                    f"draft.{key} = 0: a DraftRuntime's KV pool needs its size (set draft.max_requests and "
                    "draft.max_context, or pass them; epdraft run sizes them from its prompts)"
                )
        kwargs.setdefault("hang_timeout_s", pc.cluster.hang_timeout_s)
        kwargs.setdefault("graphs", pc.draft.cuda_graphs)
        spec = spec if spec is not None else read_draft_spec(draft_path)
        layout = MoeLayout.resolve(pc, spec.ffn, groups)
        return cls.build(draft_path, heads, groups=groups, layout=layout, spec=spec, **kwargs)

    @property
    def spec(self) -> DraftModelSpec:
        return self.draft.spec

    @property
    def block_size(self) -> int:
        return self.draft.block_size

    @torch.no_grad()
    def warm_up(self, progress: Callable[[int], None] | None = None) -> None:
        """Capture the step's CUDA graphs and the commit's of every batch bucket now, so that no
        request pays a capture later; `progress(buckets done)` after each. Without graphs it does
        nothing. Every rank of the DP group must call it at the same point, built with the same
        `max_requests` (the same buckets, as any step under graphs needs): each capture runs the
        MoE layers' collectives at the bucket's shapes (on pad rows only: nothing is drafted).
        Where the MoE layers communicate, it captures every readout's step graph (a rank's readout
        follows its own requests' sampling, which its peers do not know, so none may capture later);
        a rank alone captures the argmax one here and a sampled readout's on first use."""
        if self.graphs is None:
            return
        ranks = self.coordinator.ranks
        readouts = (Readout.ARGMAX,) if self.graphs.capture_on_first_use else tuple(Readout)
        for done, bucket in enumerate(self.graphs.buckets, start=1):
            self.watchdog.progress(phase=f"capturing the draft step for {bucket} requests")
            for readout in readouts:
                self.graphs.capture(bucket, readout, ranks)
            self.commit_graphs.capture(bucket)
            if progress is not None:
                progress(done)

    def _phase(self, name: str):
        return self.timers.phase(name) if self.timers is not None else contextlib.nullcontext()

    def add_request(
        self, request_id: int, prompt_features: torch.Tensor, sampling: SamplingParams | None = None
    ) -> None:
        """Start a request's draft context from its prompt rows' target features [L, K*H].

        sampling: how the request samples (None: greedy); its drafts are then sampled with it, and
        a request without a seed of its own draws from one derived from its id (`seeded`).
        Raises RequestError naming draft.max_requests / draft.max_context when it does not fit;
        the requests already admitted are untouched.
        """
        self.pool.admit(request_id, seeded(sampling or SamplingParams(), 0, request_id))
        try:
            with self._phase("draft_prompt"):
                self.draft.extend(self.pool, [request_id], [prompt_features])
        except RequestError:
            self.pool.release(request_id)
            raise

    def release(self, request_id: int) -> None:
        """Forget a finished request's context and free its pool slot."""
        self.pool.release(request_id)

    @torch.no_grad()
    def propose(
        self,
        step: int,
        anchors: Mapping[int, int],
        extras: tuple[int, ...] = (),
        *,
        counts: Sequence[int] | None = None,
        check_counts: bool = False,
    ) -> Proposal:
        """Agree on the step's row counts, then draft for every request in `anchors` (request id ->
        last verified token).

        Every rank must call this once per step, an idle rank with `anchors = {}`. Returns with
        empty drafts on every rank when the agreed plan says no rank has rows. No host sync on
        CUDA beyond the step's CPU-group sync (none with `counts`): the drafts stay on the device,
        and their layers' finite flags are copied to the host asynchronously, checked by the first
        `commit` that finds them arrived.

        counts: the engine's DP metadata, when it already agreed on it for its target forward:
            every rank's draft rows (its requests x block_size) in the order of the draft's DP
            group (`plan.ranks`). The step then issues no collective but its MoE dispatch. None:
            the coordinator's sync gathers them (with the step id, checked, and `extras`).
        check_counts: with `counts`, run the coordinator's sync anyway and raise StepMismatch
            on every rank when the gathered step ids differ, or the gathered counts differ from
            any rank's engine's (the sync carries a digest of each rank's `counts`: one engine
            wrong fails the whole group at once; a debugging aid: it costs the collective the
            counts save).

        The drafts are views of the step's outputs: under CUDA graphs the next `propose` of the same
        batch bucket overwrites them (copy what must outlive it).

        Raises RequestError naming requests in `anchors` never added on this rank, after the step
        (their rows ran as padding: the group's collectives stay in step, the other requests'
        drafts are lost with the error); RequestError / ParallelError naming this
        rank when `counts` contradicts its anchors or the DP group (fatal to the group, whose ranks
        then fail naming this rank's reason); StepMismatch on every rank, naming the ranks whose
        `counts` contradict the gathered ones (`check_counts`);
        ParallelError naming the lost peer(s), this step and phase when a collective fails
        because a peer died or stalled.
        """
        missing = [r for r in anchors if r not in self.pool]
        rows = len(anchors) * self.block_size
        try:
            if counts is None:
                self.watchdog.progress(step, "step sync")
                with self._phase("sync"):
                    plan = self.coordinator.sync(step, rows, extras)
            else:
                plan = self._engine_plan(step, rows, counts, extras, check_counts)
            if plan.skip:
                return Proposal(plan, {})
            self.watchdog.progress(step, "draft propose")
            ids = list(anchors)
            # a request never added runs as a padding row (the pad slot, anchor 0), raised after the step
            slots = [self.pool.pad_slot if r in missing else self.pool.slot(r) for r in ids]
            tokens = [0 if r in missing else anchors[r] for r in ids]
            readout = self.pool.readout([r for r in ids if r not in missing])
            if self.graphs is not None:
                with self._phase("draft_step_graph"):
                    out = self.graphs.run(slots, tokens, plan, readout=readout)
            else:
                with self._phase("draft_attention"):
                    slots_N, anchors_N = (launch.host_ints(v, self.draft.device) for v in (slots, tokens))
                    out = self.draft.step(self.pool, slots_N, anchors_N, self.heads, plan, readout=readout)
        except EpdraftError:
            raise
        except RuntimeError as e:
            lost = self.watchdog.lost_error(e, what=f"step {step}'s draft collectives")
            if lost is None:
                raise
            raise self._failed(lost) from e
        if ids:  # an idle rank's step drafts nothing: no flags to check
            self._keep_flags(step, out.finite_L)
        if missing:
            raise RequestError(f"propose, step {step}: requests {missing} were never added on this rank (their rows "
                               "ran as padding, so the group's collectives stayed in step)")  # fmt: skip
        confidence = {} if out.confidence_NK is None else {r: out.confidence_NK[i] for i, r in enumerate(ids)}
        probs = {} if out.probs_NKV is None else {r: out.probs_NKV[i] for i, r in enumerate(ids)}
        return Proposal(plan, {r: out.drafts_NK[i] for i, r in enumerate(ids)}, confidence, probs)

    def _engine_plan(
        self, step: int, rows: int, counts: Sequence[int], extras: tuple[int, ...], check: bool
    ) -> StepPlan:
        """The step's plan from the engine's agreed row counts, checked against what this rank knows."""
        try:
            return self._checked_engine_plan(step, rows, counts, extras, check)
        except EpdraftError as e:  # the group's ranks may not agree on the plan: none may step
            raise self._failed(e) from None

    def _checked_engine_plan(
        self, step: int, rows: int, counts: Sequence[int], extras: tuple[int, ...], check: bool
    ) -> StepPlan:
        ranks, me = self.coordinator.ranks, self.coordinator.rank
        if len(counts) != len(ranks):
            raise ParallelError(
                f"rank {me}, step {step}: the engine passed {len(counts)} row counts; the draft's DP group "
                f"has {len(ranks)} ranks {list(ranks)} (one count each, in that order)"
            )
        counts = tuple(int(c) for c in counts)
        for rank, c in zip(ranks, counts):
            if c < 0 or c % self.block_size:
                raise RequestError(
                    f"rank {me}, step {step}: the engine's count for rank {rank} is {c} rows; a count is "
                    f"that rank's requests x block_size {self.block_size}"
                )
        mine = counts[ranks.index(me)]
        if mine != rows:
            raise RequestError(
                f"rank {me}, step {step}: the engine's count for this rank is {mine} rows, but it passed "
                f"{rows // self.block_size} anchors = {rows} rows (block_size {self.block_size})"
            )
        if extras and not check:
            raise RequestError(
                f"rank {me}, step {step}: extras travel in the coordinator's sync; with the engine's counts "
                "pass none (or check_counts=True)"
            )
        if not check:
            return StepPlan(step=step, ranks=ranks, counts=counts)
        self.watchdog.progress(step, "step sync (checking the engine's counts)")
        with self._phase("sync"):
            return self.coordinator.sync(step, rows, extras, expected=counts)

    def _failed(self, error: EpdraftError) -> EpdraftError:
        """Tell the peers why this rank fails (they name it rather than calling it gone); return `error`."""
        self.watchdog.fail(str(error))
        return error

    def _keep_flags(self, step: int, finite_L: torch.Tensor) -> None:
        """Start the copy of a step's finite flags to the host (a CUDA graph's output is overwritten
        by its next replay: the copy is queued behind this one)."""
        if finite_L.device.type != "cuda":
            self._flags.append((step, finite_L, None))
            return
        host = torch.empty(finite_L.shape, dtype=finite_L.dtype, pin_memory=True)
        host.copy_(finite_L, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._flags.append((step, host, arrived))

    def _check_flags(self, what: str) -> None:
        """Raise NonFiniteError naming the step and the draft layer whose hidden states went NaN or
        inf, for every step whose flags have arrived (never waiting for the others)."""
        while self._flags and (self._flags[0][2] is None or self._flags[0][2].query()):
            step, finite_L, _ = self._flags.popleft()
            try:
                check_finite(finite_L, what, self.pool.dtype)
            except NonFiniteError as e:
                raise self._failed(NonFiniteError(f"rank {self.coordinator.rank} at step {step}: {e}")) from None

    @torch.no_grad()
    def commit(self, result: VerifyResult) -> None:
        """Append each verified request's committed rows (anchor + accepted drafts) to its context.

        Under graphs the rows go through the commit's CUDA graph of the requests' bucket: with
        `result.commit_lens` on the host (as an engine has them) nothing waits for the device.
        Raises RequestError naming draft.max_context (before writing anything) when a request's
        rows do not fit, and when the feature rows are not sum(commit_lens); NonFiniteError naming
        the step and draft layer whose hidden states went NaN or inf, once that step's flags (from
        `propose`) have reached the host.
        """
        self._check_flags(f"{len(result.request_ids)} requests verified")
        ids = list(result.request_ids)
        if not ids:
            return
        counts = result.commit_lens.tolist()
        if result.features.shape[0] != sum(counts):
            raise RequestError(
                f"commit: {result.features.shape[0]} feature rows for commit_lens {counts} (sum {sum(counts)}): "
                "the rows of each request, packed in request order, one per committed token"
            )
        with self._phase("draft_context"):
            if self.commit_graphs is None:  # the packed rows as they come: no per-request split
                write = functools.partial(self.draft.write_context, self.pool)
                self.pool.append_packed(ids, counts, result.features, write)
                return
            for rid, n in zip(ids, counts):
                self.pool.check_room(rid, n)
            self.commit_graphs.run([self.pool.slot(r) for r in ids], counts, result.features)
            for rid, n in zip(ids, counts):
                self.pool.book(rid, n)

    def close(self) -> None:
        """Free the dispatcher's buffers (every rank of the MoE group must call it) and stop the
        watchdog the runtime started (before the engine leaves the world)."""
        for dispatcher in self._dispatchers.values():
            dispatcher.close()
        if self._owns_watchdog:
            self.watchdog.stop()


def _check_row_cap(layout: MoeLayout, max_requests: int, block_size: int, graphs: bool) -> None:
    """ConfigError naming draft.max_rows_per_rank when a step of this runtime can send more rows
    than the layout's fixed buffers take: max_requests blocks, or under graphs the largest bucket's
    (every rank replays it). Found at build, not at the first step that overflows."""
    cap = layout.row_cap
    requests = default_buckets(max_requests)[-1] if graphs else max_requests
    if cap is not None and requests * block_size > cap:
        graphs_note = f" (the largest CUDA-graph bucket of draft.max_requests = {max_requests})" if graphs else ""
        raise ConfigError(
            f"draft.max_rows_per_rank = {cap}: a step can send {requests} requests{graphs_note} x {block_size} "
            f"block rows = {requests * block_size} rows from one rank, more than the {layout.backend} buffers "
            f"take; raise draft.max_rows_per_rank or lower draft.max_requests"
        )
