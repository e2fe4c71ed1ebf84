"""`epdraft launch`: the torchrun command, a two-node world on one host, and a node that never starts."""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from epdraft import launch
from epdraft.cli import main as cli_main
from epdraft.config.parallel import load_parallel_config
from epdraft.errors import ConfigError, Interrupted, RankFailed
from epdraft.launch import torchrun_command
from epdraft.parallel.failure import RankProgress
from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]
LOCAL_CPU_4 = REPO / "configs" / "local-cpu-4.toml"
TWO_NODES = ["--set", "cluster.nnodes=2", "--set", "cluster.nproc_per_node=2"]


def test_single_node_command_is_standalone():
    pc = load_parallel_config(LOCAL_CPU_4)
    cmd = torchrun_command(pc, "configs/local-cpu-4.toml", overrides=["draft.moe_tp=1"], python="python")
    assert cmd == [
        "python", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "4",
        "--max-restarts", "0", "-m", "epdraft.worker", "--config", "configs/local-cpu-4.toml",
        "--set", "draft.moe_tp=1",
    ]  # fmt: skip


def test_multi_node_command_uses_static_rendezvous_bounded_by_timeout():
    pc = load_parallel_config(LOCAL_CPU_4, ["cluster.nnodes=2", "cluster.nproc_per_node=2", "cluster.timeout_s=9.5",
                                           "cluster.hang_timeout_s=4"])
    cmd = torchrun_command(pc, "c.toml", node_rank=1, master_addr="10.0.0.1", master_port=29555, python="python")
    flags = " ".join(cmd)
    assert "--standalone" not in cmd
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29555" in flags
    assert "--rdzv-backend static --rdzv-conf timeout=10" in flags
    assert "--nproc-per-node 2" in flags and flags.endswith("-m epdraft.worker --config c.toml")
    with pytest.raises(ConfigError, match=r"--node-rank 2 is not a node index in \[0, cluster.nnodes = 2\)"):
        torchrun_command(pc, "c.toml", node_rank=2)
    with pytest.raises(ConfigError, match="--master-port 70000"):
        torchrun_command(pc, "c.toml", master_port=70000)


def test_worker_env_sets_cores_per_local_rank_only_when_unset():
    cores = len(os.sched_getaffinity(0))
    assert launch.worker_env(2, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert launch.worker_env(4 * cores, {})["OMP_NUM_THREADS"] == "1"
    assert launch.worker_env(2, {"OMP_NUM_THREADS": "7"}) == {"OMP_NUM_THREADS": "7"}


def test_dry_run_prints_the_command(capsys):
    assert cli_main(["launch", str(LOCAL_CPU_4), "--node-rank", "1", "--master-port", "29600", *TWO_NODES,
                     "--dry-run"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "torch.distributed.run --nnodes 2 --node-rank 1" in out
    assert "--set cluster.nnodes=2 --set cluster.nproc_per_node=2" in out
    assert cli_main(["launch", str(LOCAL_CPU_4), "--node-rank", "3", "--dry-run"]) == 2


def _launch(config: Path, node_rank: int, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "epdraft.cli", "launch", str(config), "--node-rank", str(node_rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port), *TWO_NODES, *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes naming any needle (our unique config path or port): psutil-free."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in argv for n in needles) and cmdline.parent.name != str(os.getpid()):
            found.append(f"{cmdline.parent.name}: {argv}")
    return found


@pytest.fixture
def config_copy(tmp_path) -> Path:
    """A uniquely named copy of local-cpu-4.toml, so leftover processes can be found by their argv."""
    path = tmp_path / f"epdraft-launch-test-{os.getpid()}.toml"
    shutil.copy(LOCAL_CPU_4, path)
    return path


@pytest.mark.timeout(300)
def test_two_launches_form_a_four_rank_world(config_copy):
    port = free_port()
    nodes = [_launch(config_copy, 0, port), _launch(config_copy, 1, port, "--log-level", "DEBUG")]
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n---\n".join(outs)
    assert "[rank 0/4]" in outs[0] and "health check passed on 4 ranks" in outs[0], outs[0]
    assert "[rank 3/4]" in outs[1] and "moe_ep 1/2, moe_tp 1/2" in outs[1], outs[1]
    assert _processes_mentioning(str(config_copy)) == []


@pytest.mark.timeout(120)
def test_missing_node_fails_within_timeout_naming_it(config_copy):
    port = free_port()
    start = time.monotonic()
    node0 = _launch(config_copy, 0, port, "--set", "cluster.timeout_s=10", "--set", "cluster.hang_timeout_s=5")
    try:
        out = node0.communicate(timeout=100)[0]
    finally:
        node0.kill()
    elapsed = time.monotonic() - start
    assert node0.returncode not in (0, None), out
    assert elapsed < 40, f"took {elapsed:.0f} s\n{out}"
    assert "1/2 nodes joined, node rank 1 did not join" in out, out
    assert "cluster.timeout_s = 10 s" in out, out
    assert "--set cluster.nnodes=2 --set cluster.nproc_per_node=2 --set cluster.timeout_s=10 --set cluster.hang_timeout_s=5` on each" in out, out
    assert _processes_mentioning(str(config_copy), f"--master-port {port}") == []


@pytest.mark.timeout(120)
def test_missing_master_fails_naming_node_0(config_copy):
    port = free_port()
    start = time.monotonic()
    node1 = _launch(config_copy, 1, port, "--set", "cluster.timeout_s=10", "--set", "cluster.hang_timeout_s=5")
    try:
        out = node1.communicate(timeout=100)[0]
    finally:
        node1.kill()
    assert node1.returncode not in (0, None), out
    assert time.monotonic() - start < 40, out
    assert f"node 1: node 0 did not join: no rendezvous at 127.0.0.1:{port}" in out, out
    assert _processes_mentioning(str(config_copy), f"--master-port {port}") == []


@pytest.mark.timeout(120)
def test_ctrl_c_to_the_launcher_is_one_line_exit_130_and_leaves_no_process_behind(config_copy):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "epdraft.cli", "launch", str(config_copy), "--log-level", "DEBUG"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        first = launcher.stdout.readline()  # at DEBUG the launcher logs the command just before starting torchrun
        assert "torch.distributed.run" in first, first
        deadline = time.monotonic() + 60
        while not any("-u -m epdraft.worker" in p for p in _processes_mentioning(str(config_copy))):
            assert time.monotonic() < deadline, "torchrun started no worker within 60 s"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)  # workers are up (importing torch or in init)
        after = launcher.communicate(timeout=90)[0]
    finally:
        launcher.kill()
    out = first + after
    assert launcher.returncode == 130, out
    assert after.endswith("epdraft launch: interrupted by SIGINT: every rank stopped\n"), out
    assert "Traceback" not in after, out
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(config_copy)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(config_copy)) == [], out


@pytest.mark.timeout(60)
def test_worker_exits_2_naming_a_bad_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(LOCAL_CPU_4.read_text().replace('moe_layout = "gather"', 'moe_layout = "alltoall"'))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "epdraft.worker", "--config", str(bad)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "[rank ?/?]" in done.stderr and f"{bad}: draft.moe_tp = 2: alltoall supports" in done.stderr, done.stderr


def _sleeper(seconds: float, on_sigterm: str = "") -> list[str]:
    """A stand-in for one node's torchrun: sleeps; on SIGTERM prints `on_sigterm` to stderr and exits 1."""
    code = (f"import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (sys.stderr.write({on_sigterm!r}), sys.exit(1)))\n"
            f"time.sleep({seconds})")  # fmt: skip
    return [sys.executable, "-c", code]


def _failer(code: int, after_s: float = 0.0) -> list[str]:
    return [sys.executable, "-c", f"import sys, time; time.sleep({after_s}); sys.exit({code})"]


def _node_args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{"config": "c.toml", "master_addr": "127.0.0.1", "master_port": 29500,
                                 "set": [], "node_rank": None, "command": "run", **changes})  # fmt: skip


TWO_NODE_PC = load_parallel_config(LOCAL_CPU_4, ["cluster.nnodes=2", "cluster.nproc_per_node=2"])


@pytest.mark.timeout(40)
@pytest.mark.parametrize("failing", [0, 1])
def test_local_nodes_name_the_node_that_failed_first_and_stop_the_other(caplog, failing):
    """Each node of a multi-node config on one host: whichever fails (node 1 too: every node is polled
    every round) is named, and the other is stopped `_PEERS_GRACE_S` (5 s) later, not at its own end."""
    cmds = [_sleeper(60), _sleeper(60)]
    cmds[failing] = _failer(3, after_s=0.5)
    start = time.monotonic()
    code = launch.run_local_nodes(cmds, TWO_NODE_PC, _node_args())
    elapsed = time.monotonic() - start
    assert code == 3
    assert launch._PEERS_GRACE_S <= elapsed < launch._PEERS_GRACE_S + 10, elapsed
    assert f"torchrun exited with code 3 on node {failing}" in caplog.text
    assert f"stopped node {1 - failing}: node {failing} failed first" in caplog.text


@pytest.mark.timeout(40)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_node_and_mutes_their_tracebacks(capfd, signum):
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signum))
    timer.start()
    start = time.monotonic()
    with pytest.raises(Interrupted, match=f"interrupted by {signum.name}: every rank stopped") as e:
        launch.run_local_nodes([_sleeper(60, "Traceback (most recent call last)\n")] * 2, TWO_NODE_PC, _node_args())
    timer.join()
    assert e.value.signum == signum
    assert time.monotonic() - start < 10
    assert "Traceback" not in capfd.readouterr().err
    assert signal.getsignal(signum) is not None  # the launcher's handler is gone again


def test_rendezvous_hints_keep_the_commands_overrides():
    class Watcher:
        nodes_joined, master_unreachable = (1, 2), False

    sets = ["cluster.nnodes=2", "draft.moe_ep=1"]
    hint = launch._explain_failure(1, Watcher(), TWO_NODE_PC, _node_args(set=sets, command="launch", node_rank=0))
    assert ("start `epdraft launch c.toml --node-rank R --master-addr 127.0.0.1 --master-port 29500 "
            "--set cluster.nnodes=2 --set draft.moe_ep=1` on each missing node") in hint  # fmt: skip
    Watcher.nodes_joined, Watcher.master_unreachable = None, True
    hint = launch._explain_failure(1, Watcher(), TWO_NODE_PC, _node_args(set=sets, node_rank=1))
    assert ("start `epdraft run c.toml --node-rank 0 --master-port 29500 --set cluster.nnodes=2 "
            "--set draft.moe_ep=1` and this command's other flags on 127.0.0.1") in hint  # fmt: skip


def test_launch_refuses_a_taken_master_port_on_node_0(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli_main(["launch", str(LOCAL_CPU_4), "--master-port", str(port), *TWO_NODES])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"epdraft launch: --master-port {port}: in use on this host"), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_worker_prints_its_stacks_on_sigusr1_and_on_a_fatal_signal():
    # Rank 0 of a world of 2 whose rank 1 never comes: it waits in init_process_group.
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "epdraft.worker", "--config", str(REPO / "configs/local-cpu-2.toml")]
    worker = subprocess.Popen(cmd, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(worker.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not _catches(worker.pid, signal.SIGUSR1):  # else SIGUSR1 would still kill it
            assert worker.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        while "in init_process_group" not in "".join(lines):
            assert worker.poll() is None and time.monotonic() < deadline, "".join(lines)
            worker.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        assert worker.poll() is None, "SIGUSR1 must not stop the worker"
        before_abort = len(lines)
        worker.send_signal(signal.SIGABRT)
        worker.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        worker.kill()
    after = "".join(lines[before_abort:])
    assert worker.returncode == -signal.SIGABRT, after
    assert "Fatal Python error: Aborted" in after and "in init_process_group" in after, after
    assert "epdraft/worker/__main__.py" in after, after


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _failing_rank(rank: int, code: int, message: str, after_s: float = 0.0) -> list[str]:
    """A stand-in node whose rank writes its reason to the launcher's --failure-dir (the last two
    arguments), then prints what torchrun would (a traceback) and exits 1."""
    body = (f"import sys, time; from epdraft.parallel.failure import write_failure; time.sleep({after_s})\n"
            f"sys.stderr.write('[rank {rank}/4] INFO before the failure\\n'); sys.stderr.flush(); time.sleep(0.5)\n"
            f"write_failure(sys.argv[sys.argv.index('--failure-dir') + 1], {rank}, {code}, {message!r})\n"
            f"sys.stderr.write('Traceback (most recent call last):\\nChildFailedError\\n'); sys.exit(1)")  # fmt: skip
    return [sys.executable, "-c", body]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("code", [1, 2])
def test_a_rank_failure_is_its_one_line_reason_with_its_exit_code(capfd, code):
    # Node 1's rank 2 fails first, node 0's rank 0 after it (it lost rank 2): rank 2's reason is the one.
    cmds = [_failing_rank(0, 1, "lost rank 2 (heartbeat gone)", after_s=1.5), _failing_rank(2, code, "rank 2: bad")]
    with pytest.raises(RankFailed, match=r"^rank 2: bad$") as e:
        launch.run_local_nodes(cmds, TWO_NODE_PC, _node_args())
    assert e.value.exit_code == code
    err = capfd.readouterr().err
    assert "[rank 2/4] INFO before the failure" in err, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err


def test_torchruns_record_of_a_killed_rank_names_it():
    stream = io.StringIO(
        "[rank 1/2] INFO serving\n"
        "E1201 20:41:27.851000 483 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
        "local_rank: 1 (pid: 489) of binary: python\n"
        "Traceback (most recent call last):\n"
        "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 488)  (SIGTERM)\n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 489)  (SIGKILL)\n  traceback : Signal 9 (SIGKILL) received by PID 489\n"
    )
    watcher = launch._StderrWatcher(stream)
    watcher.run()
    with pytest.raises(RankFailed, match=r"^rank 1 \(node 0, pid 489\) died: Signal 9 \(SIGKILL\) received by PID 489$"):
        launch._raise_rank_failure(watcher, 0, 2)
    exited = launch._StderrWatcher(io.StringIO("Root Cause (first observed failure):\n[0]:\n  rank      : 3 "
                                               "(local_rank: 1)\n  exitcode  : 2 (pid: 77)\n"))  # fmt: skip
    exited.run()
    with pytest.raises(RankFailed, match=r"^rank 3 \(node 1\) exited with code 2; its log above says why$"):
        launch._raise_rank_failure(exited, 1, 2)
    watcher.progress = {1: RankProgress(rank=1, step=3, phase="verify")}  # what its heartbeat last wrote
    with pytest.raises(RankFailed, match=r"^rank 1 \(node 0, pid 489\) died at step 3, phase verify \(its last "
                                         r"heartbeat\): Signal 9 \(SIGKILL\) received by PID 489$"):
        launch._raise_rank_failure(watcher, 0, 2)
