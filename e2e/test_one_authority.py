"""One authority per event, with real processes: the embedded cluster (emulated API server, the
real operator, the node agent running the real coordinator and workers on the CPU).

* ``kubectl delete node`` under a worker of a job that trains dp=2 with a third pod standing by
  (``minDataParallel: 2``): the runtime recovers alone, the job's status shows the world it
  committed, and the pod standing by joins at once; never a plan acked that does not run.
* Scaling a job 2 -> 1 -> 4: the scale-up's first generation commits (its joiners are handed on
  only once the pods the plan names have registered; a scaled-down predecessor's registration
  stays in the store).

Each takes a few minutes on two cores: marked long (the emulator versions run by default:
tests/integration/test_operator_emulator.py, tests/integration/test_kube_source.py).
"""

from __future__ import annotations

import sys
import time

import pytest

from liveshard.dev.localcluster import demo as demo_module
from liveshard.dev.localcluster.demo import Demo
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

pytestmark = [pytest.mark.slow, pytest.mark.long]


def job_with(monkeypatch, **spec_changes) -> None:
    """The demo's job with ``spec_changes`` merged into its spec (one level deep)."""
    original = demo_module.sample_job

    def sample_job(*args, **kwargs):
        body = original(*args, **kwargs)
        for key, value in spec_changes.items():
            body["spec"][key] = {**(body["spec"].get(key) or {}), **value}
        return body

    monkeypatch.setattr(demo_module, "sample_job", sample_job)


def world_shown(d: Demo, st: dict) -> None:
    """The status never shows a plan as applied that the coordinator does not run."""
    co = d.coordinator()
    plan = st.get("plan") or {}
    if co.get("pending") is None and co.get("generation") == (st.get("world") or {}).get("generation"):
        assert st["world"]["worldSize"] == len(co.get("members") or ()), (st.get("world"), co.get("members"))
    if Demo.acked(st) and (st.get("world") or {}).get("planGeneration") == plan.get("generation"):
        assert st["world"]["members"] == plan["members"], (st["world"], plan)


def test_a_deleted_node_is_the_runtimes_and_the_standby_takes_over(tmp_path, monkeypatch):
    job_with(monkeypatch, parallelism={"minDataParallel": 2, "distributedOptimizer": False})
    # three nodes, three pods; global batch 16 (4 micro-batches): dp=2, the third pod stands by
    d = Demo(tmp_path / "lost", job="lost", log=sys.stderr, gpu_nodes=4, replicas=3, global_batch=16)
    pod = lambda i: f"lost-worker-{i}"  # noqa: E731
    try:
        d.start()
        st = d.wait_training(2, steps=2)
        members = st["plan"]["members"]
        standby = next(pod(i) for i in range(3) if pod(i) not in members)
        kept, lost = members
        assert ",dp=2," in st["plan"]["config"] and st["world"]["worldSize"] == 2
        node = d.node_of(lost)
        t0 = time.monotonic()
        d.say(f"EVENT kubectl delete node {node} (pod {lost})")
        d.core.delete_node(node)
        # the runtime's recovery (dp=1 on what survived) shows within seconds ...
        st, _ = d.wait("the runtime's world of one", lambda s, c: (world_shown(d, s) or True)
                       and (s.get("world") or {}).get("members") == [kept], timeout=60)
        assert st["world"]["worldSize"] == 1
        # ... and the standby joins at once (not after the scale-up cooldown, not minutes later)
        st, co = d.wait("dp=2 again with the standby", lambda s, c: (world_shown(d, s) or True) and d.acked(s)
                        and sorted((s.get("world") or {}).get("members") or ()) == sorted([kept, standby]),
                        timeout=120)
        d.say(f"  dp=2 again {time.monotonic() - t0:.1f} s after the node was deleted")
        assert ",dp=2," in st["plan"]["config"] and st["world"]["worldSize"] == 2
        assert co["members"] == [f"{m}/0" for m in st["world"]["members"]]  # the rank order that runs
        observed = [h for h in st["history"] if h.get("outcome") == "Observed"]
        assert observed and observed[-1]["worldSize"] == 1
        # the coordinator writes the ack; the operator records it in the history on its next
        # reconcile (a second writer, so a read between the two sees the ack alone)
        gen = st["plan"]["generation"]

        def entry_of(s: dict) -> dict:
            return next((h for h in s.get("history") or () if h.get("generation") == gen), {})

        st, _ = d.wait(f"generation {gen} recorded as applied", lambda s, c: entry_of(s).get("outcome") is not None,
                       timeout=30)
        assert entry_of(st).get("outcome") == "Applied", st["history"][-3:]
        start = d.step()
        d.wait("2 more steps", lambda s, c: d.step() >= start + 2)
    finally:
        d.stop()


def test_scaling_1_to_4_commits_its_first_generation(tmp_path, monkeypatch):
    job_with(monkeypatch, workers={"max": 4})
    d = Demo(tmp_path / "scale", job="scale", log=sys.stderr, gpu_nodes=5, replicas=2)

    def scale(n: int) -> None:
        d.say(f"EVENT kubectl scale etj scale --replicas={n}")
        d.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, d.ns, PLURAL, d.job, {"spec": {"replicas": n}})

    try:
        d.start()
        d.wait_training(2, steps=2)
        scale(1)
        d.wait("a world of one", lambda s, c: d.acked(s) and len(c.get("members") or ()) == 1
               and "scale-worker-1" not in d.pods())
        aborted_before = sum(1 for h in d.coordinator()["history"] if h["outcome"].startswith("aborted"))
        before = d.status().get("abortedGeneration") or 0
        scale(4)
        st, co = d.wait("a world of four", lambda s, c: (world_shown(d, s) or True) and d.acked(s)
                        and len(c.get("members") or ()) == 4, timeout=300)
        assert st["plan"]["cause"] == "scale-up" and st["world"]["worldSize"] == 4
        aborted = [h for h in co["history"] if h["outcome"].startswith("aborted")]
        assert len(aborted) == aborted_before, aborted  # the scale-up's first generation committed
        assert (st.get("abortedGeneration") or 0) == before, st.get("abortReason")
    finally:
        d.stop()
