"""Start this node's worker ranks through torchrun and wait for them.

    epdraft launch configs/h200x8-dp8-ep8.toml                                   # one node
    epdraft launch configs/2node-h200x16-dp16-ep16.toml --node-rank 0 \\
        --master-addr node0 --master-port 29500                                   # on each node, rank 0..N-1

One node uses torchrun's `--standalone` rendezvous; several use the static rendezvous on
`--master-addr:--master-port` (node 0 hosts it), bounded by `cluster.timeout_s`, so a node that never
starts makes the others exit non-zero naming what did not join. torchrun runs in its own process
group, which is killed when the launcher exits: no worker outlives it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from epdraft.config.parallel import ParallelConfig, load_parallel_config
from epdraft.errors import ConfigError
from epdraft.parallel.address import is_loopback

log = logging.getLogger(__name__)

# What torch 2.x's static rendezvous prints when it gives up, on node 0 and on the other nodes.
_NODES_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_MASTER_UNREACHABLE = re.compile(r"timed out .* while trying to connect to")
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STOP_GRACE_S = 30.0
_POLL_S = 0.1
_PEERS_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="parallel config (.toml, .yaml or .json)")
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
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return run_torchrun(cmd, pc, args)


def run_torchrun(cmd: list[str], pc: ParallelConfig, args: argparse.Namespace) -> int:
    """Run a `torchrun_command` to completion; on failure log what went wrong (which node did not join).

    `args` carries the launch flags the explanation quotes: config, node_rank, master_addr, master_port.
    """
    log.info("node %d of %d: %s", args.node_rank, pc.cluster.nnodes, shlex.join(cmd))
    returncode, watcher = _run(cmd)
    if returncode != 0:
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
        log.info("node %d of %d (on this host): %s", node, pc.cluster.nnodes, shlex.join(cmd))
    results, first_failed = _run_all(cmds)
    if first_failed is None:
        return 0
    code, watcher = results[first_failed]
    node_args = argparse.Namespace(**{**vars(args), "node_rank": first_failed})
    log.error("%s", _explain_failure(code, watcher, pc, node_args))
    stopped = [node for node, (c, _) in enumerate(results) if node != first_failed and c != 0]
    if stopped:
        log.error("stopped node%s %s: node %d failed first", "s" if len(stopped) > 1 else "",
                  ", ".join(map(str, stopped)), first_failed)  # fmt: skip
    return code


class _StderrWatcher(threading.Thread):
    """Forwards torchrun's stderr line by line and remembers the rendezvous-timeout lines."""

    def __init__(self, stream: IO[str]):
        super().__init__(daemon=True)
        self.stream = stream
        self.nodes_joined: tuple[int, int] | None = None
        self.master_unreachable = False

    def run(self) -> None:
        for line in self.stream:
            sys.stderr.write(line)
            if m := _NODES_JOINED.search(line):
                self.nodes_joined = int(m.group(1)), int(m.group(2))
            elif _MASTER_UNREACHABLE.search(line):
                self.master_unreachable = True
        sys.stderr.flush()


def _run(cmd: list[str]) -> tuple[int, _StderrWatcher]:
    """Run `cmd` in its own process group, forwarding signals to it; leave no process of it behind."""
    return _run_all([cmd])[0][0]


def _run_all(cmds: Sequence[list[str]]) -> tuple[list[tuple[int, _StderrWatcher]], int | None]:
    """Run every command at once, each in its own process group, forwarding signals to all of them;
    the first to fail stops the others. Leave no process of any of them behind.

    Returns each command's (exit code, watcher) and the index of the first to fail (None when all
    succeeded).
    """
    procs = [
        subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        for cmd in cmds
    ]
    watchers = [_StderrWatcher(proc.stderr) for proc in procs]
    for watcher in watchers:
        watcher.start()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _FORWARDED_SIGNALS:
            previous[sig] = signal.signal(
                sig, lambda signum, _frame: [_signal_group(proc.pid, signum) for proc in procs]
            )
    try:
        codes, first_failed = _wait_all(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                _stop(proc)
            _signal_group(proc.pid, signal.SIGKILL)
        for watcher in watchers:
            watcher.join(timeout=5)
    # A negative code means torchrun died of a signal; report it the way a shell would.
    return [(128 - code if code < 0 else code, watcher) for code, watcher in zip(codes, watchers)], first_failed


def _wait_all(procs: Sequence[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Exit codes of `procs` once all exited, and the index of the first to fail (None if none).

    After the first failure the others get `_PEERS_GRACE_S` to fail on their own, so their ranks
    can log which peer went silent, then are stopped (`_stop`): ranks of one world would otherwise
    wait on the failed ones until their timeout.
    """
    first_failed, stop_at = None, 0.0
    while any(proc.poll() is None for proc in procs):
        if first_failed is None:
            first_failed = next((i for i, proc in enumerate(procs) if proc.returncode not in (None, 0)), None)
            stop_at = time.monotonic() + _PEERS_GRACE_S
        if first_failed is not None and time.monotonic() >= stop_at:
            for proc in procs:
                if proc.poll() is None:
                    _stop(proc)
        else:
            time.sleep(_POLL_S)
    if first_failed is None:
        first_failed = next((i for i, proc in enumerate(procs) if proc.returncode != 0), None)
    return [proc.returncode for proc in procs], first_failed


def _stop(proc: subprocess.Popen) -> None:
    """Ask torchrun to stop its workers; if it does not within the grace period, kill them and it.

    torchrun starts each worker in a session of its own, so killing torchrun's group alone would
    orphan them: their groups are found through /proc while torchrun is still their parent.
    """
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=_STOP_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    for pgid in _child_process_groups(proc.pid):
        _signal_group(pgid, signal.SIGKILL)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


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
            f"joined, {missing}; start `epdraft launch {args.config} --node-rank R --master-addr {args.master_addr} "
            f"--master-port {args.master_port}` on each missing node"
        )
    if watcher.master_unreachable:
        return (
            f"node {args.node_rank}: node 0 did not join: no rendezvous at {where} within cluster.timeout_s = "
            f"{timeout:g} s; start `epdraft launch {args.config} --node-rank 0` on {args.master_addr} "
            "(or check --master-addr/--master-port and the firewall)"
        )
    return f"torchrun exited with code {returncode} on node {args.node_rank}; the worker log above names the rank"
