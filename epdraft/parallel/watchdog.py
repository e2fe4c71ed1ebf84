"""The hang watchdog: every rank beats through the rendezvous store; a silent peer is named.

Without it a rank that stops (SIGSTOP, a C call holding the GIL, a frozen host) leaves its peers
in a collective until `cluster.timeout_s`, and a rank that dies leaves them with torch's raw
"Connection reset by peer [127.0.0.1]:PORT", which names no rank. Each rank runs one background
thread that writes a `Beat` (a counter, the main thread's last step and phase, its state) to
the store every `interval_s` and reads every peer's:

- a running peer whose counter has not moved for `hang_timeout_s` is stalled: the thread names it,
  its last step and phase, sends it SIGUSR1 when it is on this host (the worker's faulthandler
  prints its stacks) or says how to, and calls `on_stall` (the runner exits, an engine logs);
- a peer whose heartbeat still beats but whose main thread has not moved for `hang_timeout_s`
  (a deadlock, a hung kernel) while this rank's main thread has waited in a collective as long
  is stuck: named the same way. Each beat says whether the main thread waits in a collective
  (its innermost Python frame is torch.distributed's, or the store exchange's) and how long it
  has sat at one place (same frame, same instruction, no `progress` call). Ranks waiting on
  the stuck one are never named: they wait;
- a rank that names a peer puts its verdict in its beat before `on_stall` runs, so a peer whose
  collective fails because the namer exited names the same rank, not the namer;
- after a collective failed, `lost_error` waits a few beats and names the peers that stopped
  beating (gone) or that reported a failure first, with the step and phase: a `ParallelError`.
  When the store itself stopped answering, it names the rank that hosted it, alone.

`progress` wakes the thread, which beats at once (at most every `_MIN_BEAT_GAP_S`), so a rank
killed mid-step is named with the step and phase it last reported, not those of a second before.

The thread only uses its own clone of the store (no socket shared with the process group's own
use of it), and `stop` joins it before the world is left.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import torch.distributed as dist

from epdraft.errors import ParallelError
from epdraft.parallel import exchange, p2p

log = logging.getLogger(__name__)

RUNNING, DONE, FAILED = "running", "done", "failed"
# Beats a live peer gets to show it still beats, after a collective failed, before it is called gone.
_LOST_WAIT_BEATS = 3
# Errors of a collective whose peer went away (gloo, NCCL, the store), when no heartbeat says who.
_COMM_FAILURE = re.compile(
    r"Connection (reset|closed|refused)|closed by peer|Broken pipe|[Tt]imed out|wait timeout|Failed to recv"
    r"|NCCL|gloo|Socket"
)
# progress() beats at once, but no more often than this (a step reports a phase per MoE layer).
_MIN_BEAT_GAP_S = 0.02
# Where a main thread waits on its peers: torch.distributed's Python (every blocking collective
# and p2p call sits in one of its frames), the CPU step sync's store exchange, and the paired
# ranks' point-to-point waits (a Work's wait is C++: its caller's frame is the innermost).
_WAIT_FILES = (os.path.dirname(dist.__file__) + os.sep, exchange.__file__, p2p.__file__)
# Every watchdog of a process gets the next number; ranks create theirs in the same order, so
# the n-th watchdogs of every rank share keys and a later one never reads an earlier one's beats.
_GENERATION = itertools.count()


class Beat(msgspec.Struct, frozen=True, array_like=True):
    """One rank's heartbeat record in the store."""

    count: int
    step: int
    phase: str
    state: str
    pid: int
    host: str
    stacks_on_usr1: bool
    reason: str = ""
    waiting: bool = False  # the main thread waits in a collective
    still_s: float = 0.0  # how long the main thread has sat at one place
    hosts_store: bool = False  # this process serves the rendezvous store
    verdict: str = ""  # the stall this rank named (it exits or logs next)
    blamed: tuple[int, ...] = ()  # the ranks the verdict names


class _Peer:
    """What this rank last saw of a peer, and when (on this rank's monotonic clock) it last moved."""

    def __init__(self, now: float):
        self.beat: Beat | None = None
        self.moved_at = now
        self.stalled = False


class Watchdog:
    """This rank's heartbeat thread and its view of `ranks`' heartbeats.

    Args:
        store: the rendezvous store every rank of `ranks` reaches (torchrun's TCPStore, or an
            engine's); the watchdog uses a clone of it.
        ranks: the global ranks watching each other (this rank among them).
        hang_timeout_s: how long a running peer may go without a beat before it is named stalled.
        on_stall: called once, from the thread, with the one-line reason; None: log it.
        name: the key namespace, so watchdogs over different rank sets never mix.
        stacks_on_usr1: this process prints its stacks on SIGUSR1 (the worker registers
            faulthandler for it), so a peer on its host may send it one; elsewhere SIGUSR1 kills.
        on_progress: called from the thread with (step, phase) when they changed since its last
            beat (the worker keeps them in the launcher's folder).

    The thread that creates the watchdog is the one whose place is watched (the main thread of
    the runner; the engine thread that builds the runtime and steps it).
    """

    def __init__(
        self,
        store: dist.Store,
        ranks: Sequence[int],
        *,
        rank: int,
        hang_timeout_s: float,
        on_stall: Callable[[str], None] | None = None,
        name: str = "world",
        stacks_on_usr1: bool = False,
        on_progress: Callable[[int, str], None] | None = None,
    ):
        if rank not in ranks:
            raise ParallelError(f"watchdog: rank {rank} is not among the ranks it watches {list(ranks)}")
        self.rank = rank
        self.ranks = tuple(ranks)
        self.hang_timeout_s = hang_timeout_s
        self.interval_s = min(1.0, hang_timeout_s / 10)
        self.on_stall = on_stall
        self.stacks_on_usr1 = stacks_on_usr1
        self.on_progress = on_progress
        self._reported: tuple[int, str] | None = None
        self.step, self.phase = -1, "start"
        self._hosts_store = _serves_store(store)
        self._store = store.clone()
        # A store that stops answering must not freeze the thread past a beat or two.
        self._store.set_timeout(datetime.timedelta(seconds=max(2 * self.interval_s, 5.0)))
        self._watched = threading.get_ident()
        self._moves = 0  # progress() calls: a rank that reports is moving, wherever its frame is
        self._place: tuple[int, int, int] | None = None
        self._place_since = time.monotonic()
        self._waiting = False
        self._verdict, self._blamed = "", ()
        self._wake = threading.Event()
        self._store_down = False  # the last store request failed
        self._store_down_at = 0.0  # when the store stopped answering (monotonic)
        self._started = time.monotonic()
        self._prefix = f"epdraft/watchdog/{name}.{next(_GENERATION)}/"
        self._host = socket.gethostname()
        self._count = 0
        self._state, self._reason = RUNNING, ""
        self._store_lock = threading.Lock()  # the thread beats; the main thread writes the final beat
        self._view_lock = threading.Lock()
        now = time.monotonic()
        self._peers = {r: _Peer(now) for r in self.ranks if r != rank}
        self._seen: set[int] = set()  # peers whose key exists
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"epdraft-watchdog-{rank}", daemon=True)
        self._store_broken = False

    @classmethod
    def start_for(cls, group: dist.ProcessGroup, *, hang_timeout_s: float, **kwargs) -> Watchdog:
        """A started watchdog over `group`'s ranks, through the default process group's store
        (`kwargs`: on_stall, name, stacks_on_usr1)."""
        store = dist.distributed_c10d._get_default_store()
        wd = cls(store, dist.get_process_group_ranks(group), rank=dist.get_rank(), hang_timeout_s=hang_timeout_s,
                 **kwargs)  # fmt: skip
        wd.start()
        return wd

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def progress(self, step: int | None = None, phase: str | None = None) -> None:
        """Record where the main thread is and wake the thread to beat it (no store access here)."""
        self._moves += 1
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
        self._wake.set()

    def fail(self, reason: str) -> None:
        """Tell the peers this rank failed, and why, before it raises (so they name it, not 'gone')."""
        self._state, self._reason = FAILED, reason
        self._beat()

    def stop(self) -> None:
        """Join the thread and leave a final beat (`done`, or `failed` after `fail`). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._state == RUNNING:
            self._state = DONE
        self._beat()
        self._store = None

    # The thread.

    def _run(self) -> None:
        next_watch = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            woken = self._wake.wait(max(0.0, next_watch - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            self._beat()
            if time.monotonic() >= next_watch:
                self._watch()
                next_watch = time.monotonic() + self.interval_s
            if self.on_progress is not None and (now := (self.step, self.phase)) != self._reported:
                self._reported = now
                try:
                    self.on_progress(*now)
                except OSError as e:  # a full or vanished folder costs the launcher a detail, not the run
                    log.warning("watchdog: progress not recorded: %s", e)
                    self.on_progress = None
            if woken:
                self._stop.wait(_MIN_BEAT_GAP_S)

    def _sample(self) -> float:
        """Look at the watched thread: set `_waiting`, return how long it has sat at one place."""
        now = time.monotonic()
        frame = sys._current_frames().get(self._watched)
        if frame is None:  # the thread is gone (an engine stepping from another): never called stuck
            self._waiting, self._place, self._place_since = False, None, now
            return 0.0
        self._waiting = frame.f_code.co_filename.startswith(_WAIT_FILES)
        place = (id(frame), frame.f_lasti, self._moves)
        if place != self._place:
            self._place, self._place_since = place, now
        return now - self._place_since

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _beat(self) -> None:
        if self._store is None or self._store_broken:
            return
        try:
            with self._store_lock:
                self._count += 1
                still_s = self._sample()
                beat = Beat(self._count, self.step, self.phase, self._state, os.getpid(), self._host,
                            self.stacks_on_usr1, self._reason, self._waiting, still_s, self._hosts_store,
                            self._verdict, self._blamed)  # fmt: skip
                self._store.set(self._key(self.rank), msgspec.msgpack.encode(beat))
        except RuntimeError as e:  # the store's host is gone: the collectives will say so
            self._lose_store()
            self._store_broken = True
            log.warning("watchdog: the rendezvous store stopped answering (%s); heartbeats stop", e)

    def _read(self) -> dict[int, Beat]:
        """Every peer's last beat: one round trip to learn that all have beaten (a missing key would
        block a get), then one multi-get a round. Which peers are missing is asked key by key
        only once some never beat within `hang_timeout_s`, to name them."""
        with self._store_lock:
            unseen = [r for r in self._peers if r not in self._seen]
            if unseen and self._store.check([self._key(r) for r in unseen]):
                self._seen.update(unseen)
            elif unseen and time.monotonic() - self._started > self.hang_timeout_s:
                self._seen.update(r for r in unseen if not self._peers[r].stalled and self._store.check([self._key(r)]))
            ranks = sorted(self._seen)
            values = self._store.multi_get([self._key(r) for r in ranks]) if ranks else []
        return {r: msgspec.msgpack.decode(v, type=Beat) for r, v in zip(ranks, values)}

    def _watch(self) -> None:
        if self._store_broken:
            return
        try:
            beats = self._read()
        except RuntimeError:
            self._lose_store()
            return  # a slow store: the next round reads again
        self._store_down = False
        now = time.monotonic()
        waited_s = now - self._place_since if self._waiting else 0.0
        stalled, stuck, adopted = [], [], None
        with self._view_lock:
            for r, peer in self._peers.items():
                beat = beats.get(r)
                moved = beat is not None and (peer.beat is None or beat.count != peer.beat.count)
                if moved:
                    peer.beat, peer.moved_at = beat, now
                b = peer.beat
                if peer.stalled and moved and (b.waiting or b.still_s <= self.hang_timeout_s):
                    peer.stalled = False  # it beats and moves again: a stopped rank resumed, a stuck thread went on
                if b is not None and b.verdict and self.rank not in b.blamed and adopted is None:
                    adopted = (b.verdict, b.blamed)
                if peer.stalled or (b is not None and b.state != RUNNING):
                    continue
                if now - peer.moved_at > self.hang_timeout_s:
                    peer.stalled = True
                    stalled.append((r, b, now - peer.moved_at))
                elif b is not None and min(waited_s, 0.0 if b.waiting else b.still_s) > self.hang_timeout_s:
                    peer.stalled = True  # stuck: it sits outside any collective while this rank waits in one
                    stuck.append((r, b))
            if self._verdict and not any(self._peers[r].stalled for r in self._blamed if r in self._peers):
                self._verdict, self._blamed = "", ()  # every rank it named went on: peers need not take it up
            if adopted is not None and (self._verdict or stalled or stuck or not all(
                self._silent_or_still(self._peers[r], now) for r in adopted[1] if r in self._peers
            )):
                adopted = None  # this rank named someone itself, or sees a named rank beat and move
            for r in adopted[1] if adopted is not None else ():
                if r in self._peers:
                    self._peers[r].stalled = True
        if stalled or stuck:
            self._report_stall(stalled, stuck)
        elif adopted is not None:
            self._announce(*adopted)

    def _lose_store(self) -> None:
        if not self._store_down:
            self._store_down, self._store_down_at = True, time.monotonic()

    def _silent_or_still(self, peer: _Peer, now: float) -> bool:
        """Whether this rank, too, sees `peer` silent or its main thread still for half the bound
        (a peer's verdict is taken up then; a rank seen moving is not blamed on hearsay)."""
        b, half = peer.beat, self.hang_timeout_s / 2
        return b is None or now - peer.moved_at > half or (not b.waiting and b.still_s > half)

    def _report_stall(self, stalled: list[tuple[int, Beat | None, float]], stuck: list[tuple[int, Beat]]) -> None:
        parts = []
        for r, beat, silent_s in stalled:
            if beat is None:
                parts.append(f"rank {r} never sent a heartbeat in {silent_s:.0f} s")
                continue
            parts.append(f"rank {r} stalled: no heartbeat for {silent_s:.0f} s, {_last_at(beat)}; "
                         f"{self._ask_stacks(beat)}")  # fmt: skip
        for r, beat in stuck:
            parts.append(
                f"rank {r} stuck: its heartbeat beats but its main thread has not moved for {beat.still_s:.0f} s "
                f"({_last_at(beat)}, not in a collective) while rank {self.rank} waits in one; {self._ask_stacks(beat)}"
            )
        message = (
            f"{'; '.join(parts)} (cluster.hang_timeout_s = {self.hang_timeout_s:g}; noticed by rank {self.rank} "
            f"at step {self.step}, phase {self.phase})"
        )
        self._announce(message, tuple(r for r, *_ in stalled + stuck))

    def _announce(self, message: str, blamed: tuple[int, ...]) -> None:
        """Beat the verdict (a runner exits in `on_stall`: its peers then name `blamed`, not it), then report it."""
        self._verdict, self._blamed = message, blamed
        self._beat()
        if self.on_stall is None:
            log.error("%s", message)
        else:
            self.on_stall(message)

    def await_verdicts(self) -> None:
        """Wait (a few beats at most) until every peer not named has taken up this rank's verdict.

        For an `on_stall` that ends the process, after it wrote its reason: the launcher stops
        every rank once one exits, and a peer stopped before it said why names nobody.
        """
        deadline = time.monotonic() + (_LOST_WAIT_BEATS + 1) * self.interval_s + 0.5
        while time.monotonic() < deadline:
            try:
                beats = self._read()
            except RuntimeError:
                return
            if all(b.verdict or b.state != RUNNING for r, b in beats.items() if r not in self._blamed):
                return
            time.sleep(self.interval_s / 4)

    def _ask_stacks(self, beat: Beat) -> str:
        """SIGUSR1 a peer on this host (its faulthandler prints every thread's stack); elsewhere say how.

        Then SIGCONT: a stopped rank (SIGSTOP, Ctrl-Z) handles neither the SIGUSR1 nor the
        launcher's SIGTERM until it runs again, and would hold the teardown for its grace period.
        """
        if not beat.stacks_on_usr1:
            return f"pid {beat.pid} on host {beat.host}"
        if beat.host == self._host:
            try:
                os.kill(beat.pid, signal.SIGUSR1)
                os.kill(beat.pid, signal.SIGCONT)
                return f"sent SIGUSR1 to its pid {beat.pid} on this host to print its stacks"
            except OSError:
                pass
        return f"`kill -USR1 {beat.pid}` on host {beat.host} prints its stacks"

    # After a collective failed (main thread).

    def lost_error(self, e: BaseException, *, what: str = "a collective") -> ParallelError | None:
        """Name who this rank lost when `what` failed with `e`: the peers that reported a failure,
        the peers whose heartbeat is gone (waiting up to a few beats for the living to beat), the
        peers already named stalled. Returns None when no peer is missing and `e` does not read
        as a communication failure (a plain bug: the caller re-raises it)."""
        deadline = time.monotonic() + (_LOST_WAIT_BEATS + 1) * self.interval_s + 0.5
        # Counts as the store has them now, not as the thread last read them: a peer beats on every
        # `progress`, so a dead one's last beats can be several past this rank's view of it.
        try:
            fresh = self._read()
        except RuntimeError:
            self._lose_store()
            fresh = {}
        now = time.monotonic()
        with self._view_lock:
            for r, b in fresh.items():
                p = self._peers[r]
                if p.beat is None or b.count != p.beat.count:
                    p.beat, p.moved_at = b, now
            counts = {r: p.beat.count if p.beat is not None else 0 for r, p in self._peers.items()}
        while True:
            # Alive: two beats past the failure (a dead peer's last beat may still be read once after it).
            with self._view_lock:
                pending = [
                    r for r, p in self._peers.items()
                    if (p.beat.count if p.beat is not None else 0) < counts[r] + 2 and not p.stalled
                    and (p.beat is None or p.beat.state == RUNNING)
                ]  # fmt: skip
            if not pending or time.monotonic() >= deadline or not self._thread.is_alive() or self._store_down:
                break
            time.sleep(self.interval_s / 4)
        failed, gone, stalled, behind = [], [], [], []
        here = f"rank {self.rank} at step {self.step}, phase {self.phase}"
        cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        with self._view_lock:
            verdicts = [self._verdict] if self._verdict else []
            verdicts += [p.beat.verdict for p in self._peers.values()
                         if p.beat is not None and p.beat.verdict and self.rank not in p.beat.blamed]  # fmt: skip
            hosts = [(r, p.beat) for r, p in sorted(self._peers.items()) if p.beat is not None and p.beat.hosts_store]
            for r, p in sorted(self._peers.items()):
                b = p.beat
                where = "" if b is None else (f"step {b.step}, phase {b.phase}" if b.step >= 0 else f"phase {b.phase}")
                if b is not None and b.state == FAILED:
                    failed.append(f"rank {r} failed at {where}: {b.reason}")
                elif b is not None and b.state == DONE:
                    continue
                elif p.stalled:
                    stalled.append(f"rank {r} (stalled at {where})" if where else f"rank {r} (stalled)")
                elif r in pending:
                    gone.append(f"rank {r} (heartbeat gone, last at {where})" if where else f"rank {r} (never beat)")
                elif b is not None and (b.step, b.phase) != (self.step, self.phase):
                    behind.append(f"rank {r} at {where}")
        if verdicts:
            return ParallelError(f"{verdicts[0]}; then {what} failed on {here}: {cause}")
        if failed:
            return ParallelError(f"{failed[0]} ({what} failed on {here}: {cause})")
        if self._store_down and not self._hosts_store:
            # Every peer's beats stop with the store: they are not gone, its host is, unless the host
            # had ended (done) first: then the peers silent before the store went are.
            if hosts and hosts[0][1].state == RUNNING:
                r, b = hosts[0]
                return ParallelError(f"lost rank {r} (it hosted the rendezvous store, which stopped answering; "
                                     f"{_last_at(b)}): {what} failed on {here}: {cause}")  # fmt: skip
            early = [f"rank {r} (heartbeat gone, {_last_at(p.beat)})" for r, p in sorted(self._peers.items())
                     if p.beat is not None and p.beat.state == RUNNING
                     and self._store_down_at - p.moved_at > 2 * self.interval_s]  # fmt: skip
            if early:
                return ParallelError(f"lost {', '.join(early)}: {what} failed on {here}: {cause}")
            host = f"rank {hosts[0][0]}, which had ended" if hosts else "the launcher's agent, no rank of this run"
            return ParallelError(f"the rendezvous store stopped answering (hosted by {host}): {what} failed on "
                                 f"{here}: {cause}")  # fmt: skip
        if gone or stalled:
            return ParallelError(f"lost {', '.join(gone + stalled)}: {what} failed on {here}: {cause}")
        if _COMM_FAILURE.search(str(e)):
            others = f"; peers elsewhere: {', '.join(behind)}" if behind else ""
            return ParallelError(f"{what} failed on {here}, every peer still beats{others}: {cause}")
        return None


def _last_at(beat: Beat) -> str:
    return f"last at step {beat.step}, phase {beat.phase}" if beat.step >= 0 else f"last in phase {beat.phase}"


def _serves_store(store: dist.Store) -> bool:
    """Whether this process listens on the TCP port of `store` (a TCPStore, maybe under prefixes):
    then it hosts the rendezvous, and its peers lose the store with it. Reads Linux's /proc; False
    where that is missing or the store is not a TCPStore."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    port = getattr(store, "port", None)
    if not isinstance(store, dist.TCPStore) or port is None:
        return False
    inodes = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since (listdir's own descriptor among them)
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    try:
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    # local address "ADDR:PORT" (hex), state 0A = LISTEN, field 9 = the socket's inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                        return True
    except OSError:
        return False
    return False
