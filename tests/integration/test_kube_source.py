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
    store = JobStore(serve_store("127.0.0.1", 0), JOB, b"test-secret")
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


def test_a_plan_whose_pods_are_not_up_by_its_deadline_is_aborted_by_the_runtime(env):
    """The runtime answers every plan: one whose members are not all up by its deadline is
    aborted then (not after a timer of its own that the operator's would race)."""
    from datetime import UTC, datetime, timedelta

    from liveshard.runtime.contract.times import iso

    source, store, custom = env
    wall = [datetime(2026, 3, 1, 12, 0, tzinfo=UTC).timestamp()]
    source.wall = lambda: wall[0]
    deadline = datetime.fromtimestamp(wall[0], UTC) + timedelta(seconds=40)
    alive(store, "j-worker-0/0", "j-worker-0/1")  # j-worker-1 never comes up
    write_plan(custom, 1, ["j-worker-0", "j-worker-1"], deadline=iso(deadline),
               createdAt=iso(deadline - timedelta(seconds=300)))
    assert source.poll() is None and "abortedGeneration" not in status(custom)
    wall[0] += 39.0
    assert source.poll() is None and "abortedGeneration" not in status(custom)
    wall[0] += 2.0
    assert source.poll() is None
    st = status(custom)
    assert st["abortedGeneration"] == 1, st
    assert "j-worker-1/0" in st["abortReason"] and "by the plan's deadline" in st["abortReason"]
    # the next plan is a new one: its own deadline counts
    write_plan(custom, 2, ["j-worker-0", "j-worker-1"], deadline=iso(deadline + timedelta(seconds=100)))
    assert source.poll() is None and status(custom)["abortedGeneration"] == 1


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


def test_a_plan_for_a_loss_the_runtime_recovered_is_never_acked_as_a_world_that_does_not_run(env):
    """A node deleted under a worker: the runtime recovered on its own (dp=1 on what survived),
    then an operator plan for the loss arrives with another world (dp=2 with a pod that stood
    by). It is not "acked as observed": the status shows the world the runtime committed, and
    the plan is handed on as a transition from that world (a grow back), acked only once it runs."""
    source, store, custom = env
    world = ["j-worker-0/0", "j-worker-0/1", "j-worker-1/0", "j-worker-1/1"]
    alive(store, *world, "j-worker-2/0", "j-worker-2/1")
    source.report({"pending": None, "generation": 5, "config": "tp=2,pp=1,dp=1", "members": world[:2],
                   "dead": world[2:], "history": [{"generation": 5, "outcome": "committed", "config": "tp=2,pp=1,dp=1",
                                                   "world_size": 2, "cause": "lost-without-notice",
                                                   "reason": "lost j-worker-1/0, j-worker-1/1 without notice"}]})
    st = status(custom)
    assert st["world"]["generation"] == 5 and st["world"]["members"] == ["j-worker-0"]
    assert st["world"]["worldSize"] == 2 and st["world"].get("planGeneration") is None
    assert st["world"]["cause"] == "lost-without-notice" and st["world"]["committedAt"].endswith("Z")
    write_plan(custom, 7, ["j-worker-0", "j-worker-2"], cause="node-gone", reason="node-gone: x",
               leaving=["j-worker-1"])
    req = source.poll()
    assert req is not None and req.members == ("j-worker-0/0", "j-worker-0/1", "j-worker-2/0", "j-worker-2/1")
    assert "appliedGeneration" not in status(custom)
    source.report({"pending": 6, "generation": 5, "config": "tp=2,pp=1,dp=1", "members": world[:2], "history": []})
    source.report({"pending": None, "generation": 6, "config": "tp=2,pp=1,dp=2", "members": list(req.members),
                   "history": [{"generation": 6, "outcome": "committed", "config": "tp=2,pp=1,dp=2,ep=1",
                                "world_size": 4}]})
    st = status(custom)
    assert st["appliedGeneration"] == 7
    assert st["world"]["generation"] == 6 and st["world"]["planGeneration"] == 7
    assert st["world"]["members"] == ["j-worker-0", "j-worker-2"]


def test_a_plan_the_runtime_ran_otherwise_is_aborted_not_acked(env):
    """The coordinator may leave out a member that is not up; the world it commits is then not
    the plan: the plan is reported aborted, and status.world says what runs."""
    source, store, custom = env
    alive(store, "j-worker-0/0", "j-worker-0/1", "j-worker-1/0", "j-worker-1/1")
    write_plan(custom, 3, ["j-worker-0", "j-worker-1"])
    req = source.poll()
    source.report({"pending": 0, "history": []})
    source.report({"pending": None, "generation": 0, "config": "tp=2,pp=1,dp=1", "members": list(req.members[:2]),
                   "history": [{"generation": 0, "outcome": "committed", "config": "tp=2,pp=1,dp=1", "world_size": 2}]})
    st = status(custom)
    assert "appliedGeneration" not in st and st["abortedGeneration"] == 3
    assert "not the plan's" in st["abortReason"]
    assert st["world"]["worldSize"] == 2 and st["world"].get("planGeneration") is None


def test_an_observed_plan_is_acked_as_the_running_world_and_never_made_a_transition(env):
    source, store, custom = env
    world = ["j-worker-0/0", "j-worker-0/1"]
    alive(store, *world)
    source.report({"pending": None, "generation": 4, "config": "tp=2,pp=1,dp=1", "members": world,
                   "history": [{"generation": 4, "outcome": "committed", "config": "tp=2,pp=1,dp=1", "world_size": 2}]})
    assert status(custom)["world"].get("planGeneration") is None
    write_plan(custom, 9, ["j-worker-0"], config="tp=2,pp=1,dp=1,ep=1", observedWorld=4, cause="lost-without-notice")
    assert source.poll() is None
    st = status(custom)
    assert st["appliedGeneration"] == 9 and st["world"]["planGeneration"] == 9
    # the runtime moved on before the operator's record of an older world arrived: nothing to do
    source.report({"pending": None, "generation": 5, "config": "tp=1,pp=1,dp=1", "members": world[:1], "dead": world[1:],
                   "history": [{"generation": 5, "outcome": "committed", "config": "tp=1,pp=1,dp=1", "world_size": 1}]})
    write_plan(custom, 10, ["j-worker-0"], config="tp=2,pp=1,dp=1", observedWorld=4)
    assert source.poll() is None and status(custom)["appliedGeneration"] == 9
    assert status(custom)["world"]["generation"] == 5


def test_a_joiner_is_up_only_once_the_pod_the_plan_names_registered_and_beats(env):
    """Scaling 1 -> 4: the store still holds the registration and last heartbeat of an earlier
    pod of the same name (scaled down before). Handed on now, the plan's joiner would be judged
    by its predecessor's beats ("died during the transition"): it waits for the new pod."""
    source, store, custom = env
    alive(store, "j-worker-0/0", "j-worker-0/1")
    for w in ("j-worker-1/0", "j-worker-1/1"):  # the earlier pod's process, killed by the scale-down
        store.register_member(w, {"pid": 1, "incarnation": "old", "pod_uid": "uid-old"})
        store.set_json(Keys.heartbeat(w), {"time": time.time() - 60, "state": "waiting", "incarnation": "old"})
    write_plan(custom, 2, ["j-worker-0", "j-worker-1"], memberUids={"j-worker-0": "uid-0", "j-worker-1": "uid-new"})
    assert source.poll() is None
    for w in ("j-worker-1/0", "j-worker-1/1"):  # the new pod's processes register ...
        store.register_member(w, {"pid": 2, "incarnation": f"new-{w}", "pod_uid": "uid-new"})
    assert source.poll() is None  # ... but the heartbeat key still holds the earlier process's beats
    for w in ("j-worker-1/0", "j-worker-1/1"):
        store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "waiting", "incarnation": f"new-{w}"})
    req = source.poll()
    assert req is not None and req.members[2:] == ("j-worker-1/0", "j-worker-1/1")


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


def test_a_plan_naming_a_pod_whose_process_the_coordinator_judged_dead_is_aborted_at_once(env):
    """Not a wait until the plan's deadline: the coordinator's verdict is on the very pod the plan
    names (its registration carries that pod's uid); only a new pod brings a new process."""
    source, store, custom = env
    alive(store, "j-worker-0/0", "j-worker-0/1")
    for w in ("j-worker-1/0", "j-worker-1/1"):
        store.register_member(w, {"pid": 1, "incarnation": "x", "pod_uid": "uid-1"})
    source.report({"pending": None, "generation": 2, "config": "tp=2,pp=1,dp=1", "members": ["j-worker-0/0", "j-worker-0/1"],
                   "dead": ["j-worker-1/0", "j-worker-1/1"], "history": []})
    write_plan(custom, 4, ["j-worker-0", "j-worker-1"], memberUids={"j-worker-0": "uid-0", "j-worker-1": "uid-1"})
    assert source.poll() is None
    st = status(custom)
    assert st["abortedGeneration"] == 4 and "dead" in st["abortReason"]


def test_status_standby_names_pods_outside_the_world_whose_every_worker_is_up_by_uid(env):
    """``status.standby``: what a plan racing a notice may name besides the world's members."""
    source, store, custom = env
    for w in ("j-worker-0/0", "j-worker-0/1"):  # in the world
        store.register_member(w, {"pid": 1, "incarnation": f"i-{w}", "pod_uid": "uid-0"})
        store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "training", "incarnation": f"i-{w}"})
    for w in ("j-worker-1/0", "j-worker-1/1"):  # standing by, up
        store.register_member(w, {"pid": 2, "incarnation": f"i-{w}", "pod_uid": "uid-1"})
        store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "waiting", "incarnation": f"i-{w}"})
    # a recreated pod: one process registered, the other still importing (its key holds the
    # earlier process's registration and an ended beat)
    store.register_member("j-worker-2/0", {"pid": 3, "incarnation": "new-0", "pod_uid": "uid-2-new"})
    store.set_json(Keys.heartbeat("j-worker-2/0"), {"time": time.time(), "state": "waiting", "incarnation": "new-0"})
    store.register_member("j-worker-2/1", {"pid": 4, "incarnation": "old-1", "pod_uid": "uid-2-old"})
    store.set_json(Keys.heartbeat("j-worker-2/1"), {"time": time.time(), "state": "exited", "incarnation": "old-1"})
    report = {"members": ["j-worker-0/0", "j-worker-0/1"], "dead": [], "history": []}
    assert source.standby(report).pods == {"j-worker-1": "uid-1"}
    source.report(report)
    assert status(custom)["standby"] == [{"pod": "j-worker-1", "uid": "uid-1"}]
    # its second process registers from the new pod: the pod is up
    store.register_member("j-worker-2/1", {"pid": 5, "incarnation": "new-1", "pod_uid": "uid-2-new"})
    store.set_json(Keys.heartbeat("j-worker-2/1"), {"time": time.time(), "state": "waiting", "incarnation": "new-1"})
    assert source.standby(report).pods == {"j-worker-1": "uid-1", "j-worker-2": "uid-2-new"}
    # one the coordinator judged dead is not up
    assert source.standby({**report, "dead": ["j-worker-1/1"]}).pods == {"j-worker-2": "uid-2-new"}
