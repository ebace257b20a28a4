"""Cutting a world off (``comms.world.cut_off``) releases a survivor blocked in a gloo collective.

Four real processes (gloo, CPU) make a training world and a megatron-like group on it; one is
SIGKILLed. The others start an all-reduce on the group: those next to the dead peer fail at
once, but one whose all-reduce waits on a survivor stays blocked until the group's timeout
(gloo's ``abort`` does not release it). With the world cut off from another thread, every
survivor's all-reduce fails within a moment; a group made outside the world before the cut and
one made after it (the recovery's transition group) still work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from liveshard.dev.ports import free_port

pytestmark = pytest.mark.slow

SIZE = 4
GROUP_TIMEOUT = 6.0  # the world's groups' collective timeout
CUT_AFTER = 1.5  # seconds after the survivors start their all-reduce

RANK = r"""
import json, os, signal, sys, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist

from liveshard.runtime.comms import world as worlds

rank, size, port, cut, timeout, cut_after, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                                  sys.argv[4] == "cut", float(sys.argv[5]), float(sys.argv[6]),
                                                  sys.argv[7])
victim = size - 1
store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
survivors = size - 1
before = None
if rank != victim:  # a group of the survivors made before the world, outside it (a prepared plan's)
    before = worlds.build_transition_group(store, "before/", rank, survivors, 60.0)
worlds.init_training_world(store, "world/7/", rank, size, timeout)
with worlds.noting_world_connections():  # as megatron's groups are made (megatron.build.init_parallel)
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout))
t = torch.ones(16)
dist.all_reduce(t, group=group)
store.set(f"up/{rank}", "1")
if rank == victim:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
store.wait([f"up/{r}" for r in range(size)])
time.sleep(1.5)  # the victim is gone
result = {"rank": rank}

def cutter(start):
    time.sleep(cut_after)
    result["other_world"] = worlds.cut_off("world/6/")
    result["cut_at"] = time.monotonic() - start
    result["shut"] = worlds.cut_off("world/7/")
    result["again"] = worlds.cut_off("world/7/")

start = time.monotonic()
if cut:
    threading.Thread(target=cutter, args=(start,), daemon=True).start()
try:
    for _ in range(5):
        dist.all_reduce(t, group=group)
    result["error"] = None
except Exception as e:
    result["error"] = str(e)[:200]
result["blocked"] = time.monotonic() - start
while cut and "again" not in result:
    time.sleep(0.05)
x = torch.ones(1)
before.allreduce([x]).wait()
result["before_works"] = x.item() == survivors
after = worlds.build_transition_group(store, "after/", rank, survivors, 60.0)
y = torch.ones(1)
after.allreduce([y]).wait()
result["after_works"] = y.item() == survivors
with open(out, "w") as f:
    json.dump(result, f)
os._exit(0)
"""


def _run(tmp_path, cut: bool) -> list[dict]:
    port = free_port()
    name = "cut" if cut else "none"
    outs = [tmp_path / f"{name}-{r}.json" for r in range(SIZE)]
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(SIZE), str(port), name, str(GROUP_TIMEOUT),
                               str(CUT_AFTER), str(outs[r])], cwd=tmp_path) for r in range(SIZE)]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.loads(outs[r].read_text()) for r in range(SIZE - 1)]


@pytest.mark.long  # the cut in the default run: test_member_loss's survivors are released by it
def test_a_survivor_blocked_on_another_survivor_waits_for_the_timeout_unless_cut_off(tmp_path):
    # without a cut: some survivor's all-reduce waits on a survivor whose own one failed, until
    # the group's timeout (the hang seen from outside; megatron's default timeout is 30 minutes)
    uncut = _run(tmp_path, cut=False)
    assert all(r["error"] for r in uncut)
    assert max(r["blocked"] for r in uncut) > GROUP_TIMEOUT - 1, uncut

    cut = _run(tmp_path, cut=True)
    # this world's connections were shut down (a survivor whose peer had closed them all first
    # has none left to shut)
    assert any(r["shut"] for r in cut), cut
    for r in cut:
        assert r["error"], r
        assert r["shut"] is not None, r  # the cut ran
        assert r["other_world"] is None and r["again"] is None, r  # another world's prefix, or twice: nothing
        assert r["blocked"] < CUT_AFTER + 2.0, r  # released by the cut, not the timeout
        assert r["before_works"] and r["after_works"], r  # groups outside the world are untouched
