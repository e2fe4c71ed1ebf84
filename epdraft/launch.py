"""Start this node's worker ranks through torchrun and wait for them.

    epdraft launch configs/h200x8-dp8-ep8.toml                                   # one node
    epdraft launch configs/2node-h200x16-dp16-ep16.toml --node-rank 0 \\
        --master-addr node0 --master-port 29500                                   # on each node, rank 0..N-1

One node uses torchrun's `--standalone` rendezvous; several use the static rendezvous on
`--master-addr:--master-port` (node 0 hosts it), bounded by `cluster.timeout_s`, so a node that never
starts makes the others exit non-zero naming what did not join. torchrun runs in its own process
group, which is killed when the launcher exits: no worker outlives it. Its command line is logged at
DEBUG (`--log-level DEBUG`); OMP_NUM_THREADS, when unset, becomes this host's cores per local rank.

One failure, one message: the workers get a folder (`--failure-dir`) where a failing rank writes its
one-line reason (`epdraft.parallel.failure`). From the first reason on, what the ranks and
torchrun print is muted (its `ChildFailedError` traceback too; a rank's stack dump passes), and
the command ends with that reason once (`RankFailed`: exit 2 for refused input, 1 for a fault).
A rank killed before it could write one is named from torchrun's own record of the root cause.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from epdraft.config.parallel import ParallelConfig, load_parallel_config
from epdraft.errors import ConfigError, Interrupted, RankFailed
from epdraft.parallel.failure import any_failure, read_failures, read_progress

log = logging.getLogger(__name__)

# What torch 2.x's static rendezvous prints when it gives up, on node 0 and on the other nodes.
_NODES_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_MASTER_UNREACHABLE = re.compile(r"timed out .* while trying to connect to")
# torchrun's own report of a failed worker (its `failed (exitcode: ...)` line starts it), and the
# closing signals it sends the other workers: muted, the launcher says it in one line instead.
_TORCHRUN_FAILED = re.compile(r"\] failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: \d+\)")
_TORCHRUN_CLOSING = re.compile(r"\] Sending process \d+ closing signal SIG")
_ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\):")
_ROOT_FIELD = re.compile(r"^\s+(rank|exitcode|traceback)\s*:\s*(.*?)\s*$")
# faulthandler's dump of a rank's threads (`File "x", line N in f`, no comma): passes a mute.
_STACK_LINE = re.compile(r'^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):|^  File ".*", line \d+ in ')
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STOP_GRACE_S = 30.0
_POLL_S = 0.1
_PEERS_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="parallel config: a .toml, .yaml or .json file, or a shipped config's name (local-cpu-4)"
    )
    add_node_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that starts ranks shares (launch, run)."""
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, cluster.nnodes)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="host of node 0 (multi-node only)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (multi-node only)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. draft.moe_ep=2"
    )


def torchrun_command(
    pc: ParallelConfig,
    config_path: str | Path,
    *,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    overrides: Sequence[str] = (),
    worker_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The torchrun command that starts this node's `cluster.nproc_per_node` workers.

    `worker_args` are passed on to `python -m epdraft.worker` (e.g. the run job's flags).

    Raises ConfigError on a node rank outside [0, cluster.nnodes) or a port outside [1, 65535].
    """
    nnodes = pc.cluster.nnodes
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is not a node index in [0, cluster.nnodes = {nnodes})")
    if not 0 < master_port < 65536:
        raise ConfigError(f"--master-port {master_port} is not a TCP port in [1, 65535]")
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        # Static rendezvous: node ranks are the ones the user gave, and node 0's store waits at most
        # `timeout` seconds for the others before failing with how many joined.
        cmd += [
            "--nnodes", str(nnodes),
            "--node-rank", str(node_rank),
            "--master-addr", master_addr,
            "--master-port", str(master_port),
            "--rdzv-backend", "static",
            "--rdzv-conf", f"timeout={math.ceil(pc.cluster.timeout_s)}",
        ]  # fmt: skip
    cmd += ["--nproc-per-node", str(pc.cluster.nproc_per_node), "--max-restarts", "0"]
    cmd += ["-m", "epdraft.worker", "--config", str(config_path)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd + list(worker_args)


def main(args: argparse.Namespace) -> int:
    pc = load_parallel_config(args.config, args.set)
    cmd = torchrun_command(
        pc,
        args.config,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        overrides=args.set,
        # The workers log at the launcher's level (their own default is INFO, so the usual command stays short).
        worker_args=["--log-level", args.log_level] if args.log_level.upper() != "INFO" else [],
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    check_master_port(pc, [args.node_rank], args.master_port)
    return run_torchrun(cmd, pc, args)


def check_master_port(pc: ParallelConfig, node_ranks: Sequence[int], master_port: int) -> None:
    """Raise ConfigError when this host is to host the static rendezvous (node 0 of a multi-node
    config) on a port something else holds: torchrun would fail on it after importing torch, with a
    traceback, and the other nodes would wait for it until cluster.timeout_s."""
    if pc.cluster.nnodes == 1 or 0 not in node_ranks:
        return  # --standalone picks a free port itself; other nodes only connect
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT is no conflict
        try:
            probe.bind(("", master_port))
        except OSError as e:
            raise ConfigError(
                f"--master-port {master_port}: in use on this host ({e.strerror}), where node 0 hosts the "
                f"rendezvous; expected a free port, e.g. --master-port {_free_port()}"
            ) from None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def run_torchrun(cmd: list[str], pc: ParallelConfig, args: argparse.Namespace) -> int:
    """Run a `torchrun_command` to completion; on failure log what went wrong (which node did not join).

    `args` carries the launch flags the explanation quotes: config, node_rank, master_addr, master_port.
    """
    log.debug("node %d of %d: %s", args.node_rank, pc.cluster.nnodes, shlex.join(cmd))
    results, _ = _run_all([cmd], worker_env(pc.cluster.nproc_per_node))
    returncode, watcher = results[0]
    if returncode != 0:
        _raise_rank_failure(watcher, args.node_rank, pc.cluster.nproc_per_node)
        log.error("%s", _explain_failure(returncode, watcher, pc, args))
    return returncode


def run_local_nodes(cmds: Sequence[list[str]], pc: ParallelConfig, args: argparse.Namespace) -> int:
    """Run one `torchrun_command` per node, all on this host (cmds[n] is node n's), to completion.

    The first node to fail stops the others (after a few seconds in which their ranks may fail on
    their own, naming the peer they lost): they share its world and would otherwise wait on it
    until `cluster.timeout_s`. Returns that node's exit code (0 when every node succeeded) after
    logging what went wrong.
    """
    for node, cmd in enumerate(cmds):
        log.debug("node %d of %d (on this host): %s", node, pc.cluster.nnodes, shlex.join(cmd))
    results, first_failed = _run_all(cmds, worker_env(len(cmds) * pc.cluster.nproc_per_node))
    if first_failed is None:
        return 0
    code, watcher = results[first_failed]
    _raise_rank_failure(watcher, first_failed, pc.cluster.nproc_per_node)
    node_args = argparse.Namespace(**{**vars(args), "node_rank": first_failed})
    log.error("%s", _explain_failure(code, watcher, pc, node_args))
    stopped = [node for node, (c, _) in enumerate(results) if node != first_failed and c != 0]
    if stopped:
        log.error("stopped node%s %s: node %d failed first", "s" if len(stopped) > 1 else "",
                  ", ".join(map(str, stopped)), first_failed)  # fmt: skip
    return code


def worker_env(local_ranks: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torchrun's environment: `environ`, with OMP_NUM_THREADS = this process's usable cores //
    `local_ranks` (at least 1) when it is unset.

    Unset, torchrun sets 1 itself and prints a banner asking to tune it; cores per local rank is
    what that banner recommends, and keeps the ranks of one host from oversubscribing its cores.
    A value the user set is kept.
    """
    env = dict(environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // local_ranks))
    return env


def _raise_rank_failure(watcher: _StderrWatcher, node: int, nproc_per_node: int) -> None:
    """Raise RankFailed with the reason of the node that failed first: the first one its own ranks
    wrote, else torchrun's root cause when a rank died of a signal before it could write one, else
    the first reason of any node (a rank there lost one of this node's); return when none is known."""
    own = [f for f in watcher.failures if f.rank // nproc_per_node == node]
    if own:
        raise RankFailed(own[0].message, own[0].exit_code)
    cause = watcher.root_cause
    exitcode = cause.get("exitcode", "")
    if "rank" in cause and exitcode.startswith("-"):
        rank = cause["rank"].split()[0]
        pid = re.search(r"pid: (\d+)", exitcode)
        why = cause.get("traceback") or f"exit code {exitcode}"
        last = watcher.progress.get(int(rank)) if rank.isdigit() else None
        at = f" at {last.where} (its last heartbeat)" if last is not None else ""
        raise RankFailed(f"rank {rank} (node {node}{f', pid {pid.group(1)}' if pid else ''}) died{at}: {why}", 1)
    if watcher.failures:
        raise RankFailed(watcher.failures[0].message, watcher.failures[0].exit_code)
    if "rank" in cause and (code := re.match(r"(\d+)", exitcode)):
        # It exited without writing why (before it could: its command line, an exit of its own).
        raise RankFailed(f"rank {cause['rank'].split()[0]} (node {node}) exited with code {code.group(1)}; "
                         "its log above says why", int(code.group(1)))  # fmt: skip


class _StderrWatcher(threading.Thread):
    """Forwards torchrun's stderr line by line and remembers the rendezvous-timeout lines and
    torchrun's root cause; mutes from the first rank failure in `failure_dir` on."""

    def __init__(self, stream: IO[str], failure_dir: str | None = None):
        super().__init__(daemon=True)
        self.stream = stream
        self.failure_dir = failure_dir
        self.nodes_joined: tuple[int, int] | None = None
        self.master_unreachable = False
        # Set once the user interrupts: what torchrun and the ranks print while stopping is their
        # tracebacks of the signal (~90 lines), not news.
        self.muted = False
        self.failures: list = []  # the ranks' RankFailures, earliest first, once the run is over
        self.progress: dict = {}  # every rank's last RankProgress, once the run is over
        self.root_cause: dict[str, str] = {}
        self._torchrun_report = False
        self._in_root_cause = False

    def run(self) -> None:
        for line in self.stream:
            self._read_torchrun(line)
            if not self.muted and self.failure_dir and any_failure(self.failure_dir):
                self.muted = True  # a rank said why it failed: the launcher prints that, once
            quiet = self._torchrun_report or _TORCHRUN_CLOSING.search(line)
            if not quiet and (not self.muted or _STACK_LINE.search(line)):
                sys.stderr.write(line)
            if m := _NODES_JOINED.search(line):
                self.nodes_joined = int(m.group(1)), int(m.group(2))
            elif _MASTER_UNREACHABLE.search(line):
                self.master_unreachable = True
        sys.stderr.flush()

    def _read_torchrun(self, line: str) -> None:
        if _TORCHRUN_FAILED.search(line):
            self._torchrun_report = True
        if _ROOT_CAUSE.search(line):
            self._in_root_cause = True
        elif self._in_root_cause and (m := _ROOT_FIELD.match(line)):
            self.root_cause.setdefault(m.group(1), m.group(2))


def _run_all(
    cmds: Sequence[list[str]], env: Mapping[str, str] | None = None
) -> tuple[list[tuple[int, _StderrWatcher]], int | None]:
    """Run every command at once, each in its own process group; the first to fail stops the others.
    SIGINT, SIGTERM or SIGHUP stops them all. Leave no process of any of them behind.

    `env`: every command's environment (None: this process's). Each command gets `--failure-dir DIR`
    appended (a worker flag: every command is a torchrun of `epdraft.worker`), a folder shared by
    all and removed at the end; each watcher holds the failures the ranks wrote there.

    Returns each command's (exit code, watcher) and the index of the first to fail (None when all
    succeeded). Raises Interrupted, once every process is gone, when a signal stopped them.
    """
    failure_dir = tempfile.mkdtemp(prefix="epdraft-failures-")
    try:
        return _run_all_reporting(cmds, failure_dir, env)
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)


def _run_all_reporting(
    cmds: Sequence[list[str]], failure_dir: str, env: Mapping[str, str] | None
) -> tuple[list[tuple[int, _StderrWatcher]], int | None]:
    procs = [
        subprocess.Popen([*cmd, "--failure-dir", failure_dir], stderr=subprocess.PIPE, text=True, errors="replace",
                         env=env, start_new_session=True)  # fmt: skip
        for cmd in cmds
    ]
    watchers = [_StderrWatcher(proc.stderr, failure_dir) for proc in procs]
    for watcher in watchers:
        watcher.start()
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only noted here: `_wait_all` stops every node once (a second SIGTERM cuts torchrun's own shutdown short).
        if not interrupted:
            interrupted.append(signum)
            for watcher in watchers:
                watcher.muted = True

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            previous[sig] = signal.signal(sig, on_signal)
    try:
        codes, first_failed = _wait_all(procs, stop=lambda: bool(interrupted))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(procs)
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)
        for watcher in watchers:
            watcher.join(timeout=5)
    if interrupted:
        raise Interrupted(interrupted[0])
    failures, progress = read_failures(failure_dir), read_progress(failure_dir)
    for watcher in watchers:
        watcher.failures, watcher.progress = failures, progress
    # A negative code means torchrun died of a signal; report it the way a shell would.
    return [(128 - code if code < 0 else code, watcher) for code, watcher in zip(codes, watchers)], first_failed


def _wait_all(
    procs: Sequence[subprocess.Popen], stop: Callable[[], bool] = lambda: False
) -> tuple[list[int], int | None]:
    """Exit codes of `procs` once all exited, and the index of the first to fail (None if none).

    Every process is polled every round, so whichever fails first is the one named. After the
    first failure the others get `_PEERS_GRACE_S` to fail on their own, so their ranks can log which
    peer went silent, then are stopped (`_stop`): ranks of one world would otherwise wait on the
    failed ones until their timeout. `stop()` true (the user interrupted) stops them at once.
    """
    first_failed, stop_at = None, math.inf
    while None in (codes := [proc.poll() for proc in procs]):
        if first_failed is None:
            first_failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if first_failed is not None:
                stop_at = time.monotonic() + _PEERS_GRACE_S
        if stop() or time.monotonic() >= stop_at:
            _stop(procs)
        else:
            time.sleep(_POLL_S)
    if first_failed is None:
        first_failed = next((i for i, proc in enumerate(procs) if proc.returncode != 0), None)
    return [proc.returncode for proc in procs], first_failed


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Ask each running torchrun to stop its workers, once; kill whatever is left after the grace period.

    torchrun starts each worker in a session of its own, so killing torchrun's group alone would
    orphan them: their groups are found through /proc while torchrun is still their parent, and
    killed at the end even when torchrun exited (a second SIGTERM, or one during its startup, can
    make it exit without stopping them).
    """
    running = [proc for proc in procs if proc.poll() is None]
    workers = {pgid for proc in running for pgid in _child_process_groups(proc.pid)}
    for proc in running:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            workers |= _child_process_groups(proc.pid)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    for pgid in workers:
        _signal_group(pgid, signal.SIGKILL)


def _child_process_groups(parent: int) -> set[int]:
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its closing paren.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            groups.add(int(fields[2]))
    return groups


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _explain_failure(returncode: int, watcher: _StderrWatcher, pc: ParallelConfig, args: argparse.Namespace) -> str:
    nnodes, timeout = pc.cluster.nnodes, pc.cluster.timeout_s
    where = f"{args.master_addr}:{args.master_port}"
    # The command to start on a missing node: this one's, with its overrides (the nodes must agree on the layout).
    command = f"epdraft {getattr(args, 'command', 'launch')} {shlex.quote(str(args.config))}"
    sets = "".join(f" --set {shlex.quote(item)}" for item in args.set)
    also = " and this command's other flags" if getattr(args, "command", "launch") == "run" else ""
    if watcher.nodes_joined is not None:
        joined, expected = watcher.nodes_joined
        others = list(range(1, nnodes))
        missing = (
            f"node rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} did not join"
            if joined == 1
            else f"{expected - joined} of node ranks 1..{nnodes - 1} did not join"
        )
        return (
            f"rendezvous at {where} timed out after cluster.timeout_s = {timeout:g} s: {joined}/{expected} nodes "
            f"joined, {missing}; start `{command} --node-rank R --master-addr {args.master_addr} "
            f"--master-port {args.master_port}{sets}`{also} on each missing node"
        )
    if watcher.master_unreachable:
        return (
            f"node {args.node_rank}: node 0 did not join: no rendezvous at {where} within cluster.timeout_s = "
            f"{timeout:g} s; start `{command} --node-rank 0 --master-port {args.master_port}{sets}`{also} on "
            f"{args.master_addr} (or check --master-addr/--master-port and the firewall)"
        )
    return f"torchrun exited with code {returncode} on node {args.node_rank}; the worker log above names the rank"
