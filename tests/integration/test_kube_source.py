"""KubePlanSource against the API emulator and a real c10d store: operator plans in, acks out."""

from __future__ import annotations

import time

import kubernetes.client as k8s
import pytest

from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import worker_ids
from liveshard.runtime.control.store import JobStore, serve_store
from liveshard.runtime.coordinator.kube_source import KubePlanSource, pod_speeds

NS, JOB = "default", "j"


@pytest.fixture
def env(kube):
    store = JobStore(serve_store("127.0.0.1", 0), JOB)
    custom = k8s.CustomObjectsApi(kube.api_client())
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob", "metadata": {"name": JOB},
            "spec": {"model": {"preset": "tiny-gpt"}, "image": "x", "workers": {"max": 4, "gpusPerWorker": 2},
                     "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64}}}
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    source = KubePlanSource(store, JOB, NS, api=kube.api_client(), poll_interval=0.0)
    yield source, store, custom
    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, JOB)


def write_plan(custom, gen: int, members: list[str], config: str = "tp=2,pp=1,dp=2", **extra) -> None:
    plan = {"generation": gen, "config": config, "members": members, "gpusPerWorker": 2,
            "reason": extra.pop("reason", "initial"), **extra}
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, JOB, {"status": {"plan": plan}})


def status(custom) -> dict:
    return custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, JOB).get("status") or {}


def alive(store, *workers: str) -> None:
    for w in workers:
        store.register_member(w, {"pid": 1})
        store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "waiting"})


def test_worker_ids_expand_pods_in_rank_order():
    assert worker_ids(["b", "a"], 2) == ("b/0", "b/1", "a/0", "a/1")


def test_a_pods_speed_is_its_slowest_devices_compute_speed():
    health = {"members": {"a/0": {"speed": 1.2}, "a/1": {"speed": 0.9}, "b/0": {"speed": 0.5},
                          "c/0": {"speed": 0.01}}}
    assert pod_speeds(health) == {"a": 0.9, "b": 0.5, "c": 0.05}  # capped at 1, floored at 0.05
    assert pod_speeds({}) == {}


def test_plan_waits_for_its_workers_then_is_acked_when_committed(env):
    source, store, custom = env
    write_plan(custom, 1, ["j-worker-1", "j-worker-0"])
    assert source.poll() is None  # no worker has registered yet
    alive(store, "j-worker-1/0", "j-worker-1/1", "j-worker-0/0", "j-worker-0/1")
    req = source.poll()
    assert req.members == ("j-worker-1/0", "j-worker-1/1", "j-worker-0/0", "j-worker-0/1")
    assert req.config == "tp=2,pp=1,dp=2" and req.switch_at_step is None
    assert source.poll() is None  # handed on once
    # the coordinator publishes it as runtime generation 0, then commits it
    source.report({"pending": 0, "history": [], "members": []})
    assert "appliedGeneration" not in status(custom)
    source.report({"pending": None, "generation": 0, "config": "tp=2,pp=1,dp=2,ep=1", "members": list(req.members),
                   "history": [{"generation": 0, "outcome": "committed"}]})
    st = status(custom)
    assert st["appliedGeneration"] == 1 and st["appliedAt"].endswith("Z")


def test_runtime_generations_stay_apart_and_a_matching_plan_is_acked_at_once(env):
    source, store, custom = env
    alive(store, "j-worker-0/0", "j-worker-0/1", "j-worker-1/0", "j-worker-1/1")
    write_plan(custom, 3, ["j-worker-0", "j-worker-1"])
    source.poll()
    source.report({"pending": 0, "history": []})
    world = ["j-worker-0/0", "j-worker-0/1", "j-worker-1/0", "j-worker-1/1"]
    source.report({"pending": None, "generation": 0, "config": "tp=2,pp=1,dp=2", "members": world,
                   "history": [{"generation": 0, "outcome": "committed"}]})
    assert status(custom)["appliedGeneration"] == 3
    # the runtime recovers on its own (runtime generation 1): nothing is written for it
    survivors = world[:2]
    source.report({"pending": None, "generation": 1, "config": "tp=2,pp=1,dp=1", "members": survivors, "dead": world[2:],
                   "history": [{"generation": 0, "outcome": "committed"}, {"generation": 1, "outcome": "committed"}]})
    assert status(custom)["appliedGeneration"] == 3
    # the operator's plan for the same survivors needs no new world: acked directly
    write_plan(custom, 4, ["j-worker-0"], config="tp=2,pp=1,dp=1,ep=1", reason="node-gone: x", leaving=["j-worker-1"])
    assert source.poll() is None
    assert status(custom)["appliedGeneration"] == 4
    assert source.runtime_of == {3: 0}


def test_the_operators_plan_for_a_loss_the_runtime_recovered_is_recorded_not_made_again(env):
    """One authority per event: a loss without notice is the runtime's; the operator's plan for
    it, even with another config (it plans from what it sees), is acked as the world the runtime
    already made, never handed on as a second transition."""
    source, store, custom = env
    world = ["j-worker-0/0", "j-worker-0/1", "j-worker-1/0", "j-worker-1/1"]
    alive(store, *world)
    source.report({"pending": None, "generation": 5, "config": "tp=2,pp=1,dp=1", "members": world[:2],
                   "dead": world[2:], "history": [{"generation": 5, "outcome": "committed"}]})
    write_plan(custom, 7, ["j-worker-0"], config="tp=1,pp=2,dp=1", cause="node-gone", reason="node-gone: x",
               leaving=["j-worker-1"])
    assert source.poll() is None
    assert status(custom)["appliedGeneration"] == 7
    # a plan for an announced signal (a spot notice) is the operator's: handed on as usual
    write_plan(custom, 8, ["j-worker-0"], config="tp=1,pp=2,dp=1", cause="spot-interruption",
               reason="spot", leaving=["j-worker-1"])
    req = source.poll()
    assert req is not None and req.members == ("j-worker-0/0", "j-worker-0/1")


def test_a_rejected_or_aborted_plan_is_reported_aborted(env):
    source, store, custom = env
    alive(store, "j-worker-0/0", "j-worker-0/1")
    write_plan(custom, 5, ["j-worker-0"], config="tp=2,pp=1,dp=1")
    assert source.poll() is not None
    source.report({"pending": None, "history": [{"generation": None, "outcome": "rejected: no fit"}]})
    st = status(custom)
    assert st["abortedGeneration"] == 5 and "no fit" in st["abortReason"]
    write_plan(custom, 6, ["j-worker-0"], config="tp=2,pp=1,dp=1")
    assert source.poll() is not None
    source.report({"pending": 7, "history": []})
    source.report({"pending": None, "history": [{"generation": 7, "outcome": "aborted: member died"}]})
    st = status(custom)
    assert st["abortedGeneration"] == 6 and st["abortReason"] == "aborted: member died"
    assert "appliedGeneration" not in st


def test_a_stop_plan_becomes_a_stop_request_and_is_acked_when_saved(env):
    source, store, custom = env
    world = ["j-worker-0/0", "j-worker-0/1"]
    alive(store, *world)
    source.report({"pending": None, "generation": 0, "config": "tp=2,pp=1,dp=1", "members": world,
                   "history": [{"generation": 0, "outcome": "committed"}]})
    write_plan(custom, 8, [], config="", reason="below-min-workers: 1 of 2")
    req = source.poll()
    assert req is not None and req.config == "" and req.members == () and "below-min-workers" in req.reason
    source.report({"pending": 1, "generation": 0, "config": "tp=2,pp=1,dp=1", "members": world, "history": []})
    source.report({"pending": None, "generation": 1, "config": "", "members": [],
                   "history": [{"generation": 0, "outcome": "committed"}, {"generation": 1, "outcome": "committed"}]})
    assert status(custom)["appliedGeneration"] == 8
    # a second stop while stopped needs nothing: acked at once
    write_plan(custom, 9, [], config="", reason="no-feasible-plan")
    assert source.poll() is None
    assert status(custom)["appliedGeneration"] == 9


def test_checkpoint_reports_and_a_terminal_failure_reach_the_jobs_status(env):
    source, _store, custom = env
    now = time.time()
    source.report({"pending": None, "history": [], "checkpoints": {
        "latest": {"path": "/ckpt/step00000004", "step": 4},
        "failed": {"step": 6, "error": "No space left on device", "count": 1, "time": now}}})
    st = status(custom)["checkpoints"]
    assert st["latest"] == {"path": "/ckpt/step00000004", "step": 4} and st["failedSaves"] == 1
    assert st["lastFailedStep"] == 6 and "No space left" in st["lastFailure"]
    source.report({"pending": None, "history": [], "checkpoints": {},
                   "failure": {"reason": "NoSurvivingCopy", "message": "no copy of x", "time": now}})
    failure = status(custom)["runtimeFailure"]
    assert failure["reason"] == "NoSurvivingCopy" and failure["message"] == "no copy of x"
