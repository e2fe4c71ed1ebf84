"""Leaving the world frees it: after `leave_world` no gloo thread is left to run into interpreter
shutdown, even with the device mesh's subgroups built and the target (transformers) loaded after joining."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]

RANK_BODY = textwrap.dedent(
    """
    import datetime, os
    import torch, torch.distributed as dist
    from epdraft.config.parallel import load_parallel_config
    from epdraft.target.hf import HFTarget
    from epdraft.parallel.groups import Groups
    from epdraft.parallel.world import join_world, leave_world

    join_world("gloo", timeout=datetime.timedelta(seconds=30))
    groups = Groups.from_config(load_parallel_config("configs/local-cpu-2.toml"))  # 2 ranks, moe_ep 2
    dist.all_reduce(torch.ones(1), group=groups.moe)
    HFTarget.from_pretrained("epdraft/assets/tiny-target", [1], dtype=torch.float32, device=torch.device("cpu"))
    dist.all_reduce(torch.ones(1))
    cycle = {"groups": groups}  # as a run's objects may hold them: garbage only the cycle collector frees
    cycle["self"] = cycle
    del cycle, groups
    leave_world()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("gloo threads:", sorted(n for n in names if "gloo" in n))
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
@pytest.mark.timeout(120)
def test_leaving_frees_every_group():
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK_BODY], env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    try:
        outs = [p.communicate(timeout=100) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err
        assert "gloo threads: []" in out, out + err
