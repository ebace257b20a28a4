"""Jobs on the local cluster's pieces: the API emulator, the real operator (kopf, in a thread) and
the node agent as scheduler and kubelet, with worker pods that run small shell commands instead
of training. The test plays the runtime's coordinator (it acks plans, it reports the end).

First the node agent alone, as a kubelet reports a container that stopped and as it runs a pod
re-created under its predecessor's name; then two stories through the operator: workers that all
exit on the same bad input end the job ``Failed`` with their own message, and a job that loses a
node to a spot notice grows back when the taint is removed and leaves nothing running or pending
once it has succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes.client as k8s
import pytest
from test_operator_emulator import Operator, wait_for

from liveshard.dev.localcluster.node_agent import SOCKET_SAFE_TMPDIR, NodeAgent
from liveshard.operator.endings import FINISHED_WORKER_GRACE_SECONDS
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.status import Finished

BAD_INPUT = "liveshard worker: error: spec.training.data.path: /opt/liveshard/corpus does not exist (fix: ...)"
SPOT = {"karpenter.sh/capacity-type": "spot"}  # GPU nodes where the coordinator never goes: it stays Pending


def pod_body(name: str, script: str, fallback: bool = True) -> dict:
    container = {"name": "main", "image": "busybox", "command": ["sh", "-c", script]}
    if fallback:
        container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [container], "restartPolicy": "Never"}}


def settle(agent: NodeAgent, core: k8s.CoreV1Api, ns: str, name: str, phase: str, timeout: float = 20.0) -> k8s.V1Pod:
    """Run the agent's loop by hand until the pod reaches ``phase``."""
    deadline = time.monotonic() + timeout
    while True:
        agent.sync()
        pod = core.read_namespaced_pod(name, ns)
        if pod.status.phase == phase:
            return pod
        assert time.monotonic() < deadline, f"{name} stayed {pod.status.phase}, never {phase}"
        time.sleep(0.05)


def live_members(pgid: int) -> list[int]:
    """Processes of a process group that are not zombies (those wait for their reaper)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


# ---- the node agent as a kubelet ----------------------------------------------------------------
def test_a_stopped_container_reports_its_exit_code_and_its_log_tail(kube, tmp_path):
    ns = "exits"
    core = k8s.CoreV1Api(kube.api_client())
    agent = NodeAgent(kube.api_client(), tmp_path, period=0.05)
    try:
        agent.add_node("exits-node", gpus=0)
        core.create_namespaced_pod(ns, pod_body("bad", f"echo reading the spec; echo '{BAD_INPUT}' >&2; exit 2"))
        core.create_namespaced_pod(ns, pod_body("quiet", "exit 3", fallback=False))
        core.create_namespaced_pod(ns, pod_body("done", "echo all done"))
        bad = settle(agent, core, ns, "bad", "Failed")
        state = bad.status.container_statuses[0].state.terminated
        assert (state.exit_code, state.reason) == (2, "Error")
        assert state.message == f"reading the spec\n{BAD_INPUT}\n"  # FallbackToLogsOnError: the log's tail
        assert bad.status.message is None  # a kubelet says nothing at the pod's level for a container's exit
        assert not bad.status.container_statuses[0].ready
        quiet = settle(agent, core, ns, "quiet", "Failed").status.container_statuses[0].state.terminated
        assert (quiet.exit_code, quiet.message) == (3, None)  # the default policy: no file, no message
        done = settle(agent, core, ns, "done", "Succeeded").status.container_statuses[0].state.terminated
        assert (done.exit_code, done.reason, done.message) == (0, "Completed", None)  # logs only on error
        # `kubectl get pods` shows how each container ended, as a real server's table does
        request = urllib.request.Request(f"{kube.url}/api/v1/namespaces/{ns}/pods",
                                         headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
        with urllib.request.urlopen(request, timeout=10) as response:
            table = json.load(response)
        status = [c["name"] for c in table["columnDefinitions"]].index("Status")
        assert {r["cells"][0]: r["cells"][status] for r in table["rows"]} == {
            "bad": "Error", "quiet": "Error", "done": "Completed"}
    finally:
        agent.stop()


def test_a_pod_recreated_under_its_predecessors_name_runs_its_own_process(kube, tmp_path):
    """The predecessor exited (a leaver after its plan's commit), was deleted, and a new pod of
    that name was created before the agent looked again, on a node that was tainted then and is
    free now: it is bound and started, never taken for the old one (which left it Pending)."""
    ns = "again"
    core = k8s.CoreV1Api(kube.api_client())
    agent = NodeAgent(kube.api_client(), tmp_path, period=0.05)
    try:
        agent.add_node("again-node", gpus=1)
        body = pod_body("w", "exit 0")
        body["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        core.create_namespaced_pod(ns, body)
        settle(agent, core, ns, "w", "Succeeded")
        agent.taint("again-node")
        core.delete_namespaced_pod("w", ns)  # exited: gone at once (no kubelet has anything to stop)
        body["spec"]["containers"][0]["command"] = ["sh", "-c", "exec sleep 60"]
        core.create_namespaced_pod(ns, body)
        agent.sync()
        assert core.read_namespaced_pod("w", ns).status.phase == "Pending"  # tainted: not scheduled
        core.patch_node("again-node", {"spec": {"taints": None}})
        pod = settle(agent, core, ns, "w", "Running")
        assert pod.spec.node_name == "again-node" and agent.starts["w"] == 2
        assert agent.processes()[f"{ns}/w"] == agent.procs[(ns, "w")].proc.pid
    finally:
        agent.stop()


def test_what_a_pod_started_ends_with_it_when_it_is_deleted(kube, tmp_path):
    """The pod's main process ended on its own (SIGTERM, exit 0) and the pod was deleted before
    the agent saw the exit: the processes it left behind go too, as a container's do."""
    ns = "orphans"
    core = k8s.CoreV1Api(kube.api_client())
    agent = NodeAgent(kube.api_client(), tmp_path, period=0.05)
    try:
        agent.add_node("orphans-node", gpus=0)
        core.create_namespaced_pod(ns, pod_body("p", "trap 'exit 0' TERM; sleep 600 & wait"))
        settle(agent, core, ns, "p", "Running")
        proc = agent.procs[(ns, "p")].proc
        time.sleep(0.3)  # the shell has started its child
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        core.delete_namespaced_pod("p", ns)
        agent.sync()
        assert wait_for(lambda: not live_members(proc.pid), timeout=5, what="the pod's processes gone")
    finally:
        agent.stop()


def test_a_pods_volumes_are_its_own_directories_under_the_agents(kube):
    """An emptyDir is the pod's own directory (a second pod of the same spec never sees what the
    first wrote, and it goes when the pod is deleted), a claim is one directory its pods share, and
    the container's paths under a mount (env, JSON env, args) and its temporary files land there:
    nothing outside the agent's directory."""
    ns = "volumes"
    core = k8s.CoreV1Api(kube.api_client())
    tmp_path = Path(tempfile.mkdtemp(prefix="lsv-"))  # short: a pod's /tmp is its TMPDIR only then
    agent = NodeAgent(kube.api_client(), tmp_path, period=0.05)
    script = ('test ! -e "$CKPT/seen" && echo "$SPEC" > "$CKPT/seen" && f=$(mktemp "$SHARED/x.XXXXXX") && echo "$0" > "$f" '
              '&& python3 -c "import tempfile; print(tempfile.mkdtemp())" > "$CKPT/tmp"')

    def body(name: str) -> dict:
        pod = pod_body(name, script)
        container = pod["spec"]["containers"][0]
        container["args"] = ["/shared/arg"]
        container["env"] = [{"name": "CKPT", "value": "/checkpoints"}, {"name": "SHARED", "value": "/shared"},
                            {"name": "SPEC", "value": json.dumps({"path": "/checkpoints/x", "n": 1})}]
        container["volumeMounts"] = [{"name": "ckpt", "mountPath": "/checkpoints"},
                                     {"name": "data", "mountPath": "/shared"}, {"name": "tmp", "mountPath": "/tmp"}]
        pod["spec"]["volumes"] = [{"name": "ckpt", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                                  {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
        return pod
    try:
        agent.add_node("volumes-node", gpus=0)
        core.create_namespaced_pod(ns, body("a"))
        first = settle(agent, core, ns, "a", "Succeeded")
        own = tmp_path / "pods" / first.metadata.uid[:8]
        assert json.loads((own / "ckpt" / "seen").read_text()) == {"n": 1, "path": f"{own / 'ckpt'}/x"}
        assert len(str(own / "tmp")) <= SOCKET_SAFE_TMPDIR  # (else the system's: Unix sockets need short paths)
        assert Path((own / "ckpt" / "tmp").read_text().strip()).parent == own / "tmp"
        core.delete_namespaced_pod("a", ns)
        agent.sync()
        assert not own.exists()  # the emptyDirs went with the pod
        core.create_namespaced_pod(ns, body("a"))  # the same spec again: an empty checkpoint directory
        settle(agent, core, ns, "a", "Succeeded")
        shared = sorted((tmp_path / "claims" / ns / "data").iterdir())
        assert len(shared) == 2 and {p.read_text() for p in shared} == {f"{tmp_path / 'claims' / ns / 'data'}/arg\n"}
        assert not Path("/checkpoints/seen").exists() and not Path("/shared").exists()
    finally:
        agent.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


# ---- through the operator -----------------------------------------------------------------------
class Jobs:
    def __init__(self, kube, tmp_path, ns: str, nodes: int) -> None:
        self.ns = ns
        api = kube.api_client()
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.agent = NodeAgent(api, tmp_path, period=0.1)
        self.nodes = [f"{ns}-{i}" for i in range(nodes)]
        for name in self.nodes:
            self.agent.add_node(name, gpus=1, labels=SPOT)
        self.agent.start()
        self.operator = Operator(kube.url, namespaces=(ns,)).start()

    def stop(self) -> None:
        self.operator.stop()
        self.agent.stop()
        for name in self.nodes:  # nodes are the cluster's: the next test gets its own
            self.core.delete_node(name)

    def create(self, name: str, replicas: int, script: str) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {"model": {"preset": "gpt-125m"}, "image": "ghcr.io/example/train:1",
                     "command": ["sh", "-c", script], "workers": {"min": 1, "max": replicas, "gpusPerWorker": 1},
                     "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64},
                     "elasticity": {"scaleUpCooldownSeconds": 1}}})

    def status(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name).get("status") or {}

    def patch_status(self, name: str, status: dict) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, PLURAL, name, {"status": status})

    def pods(self) -> dict[str, k8s.V1Pod]:
        return {p.metadata.name: p for p in self.core.list_namespaced_pod(self.ns).items}

    def phases(self) -> dict[str, str]:
        return {n: "Terminating" if p.metadata.deletion_timestamp else p.status.phase for n, p in self.pods().items()}

    def acked(self, name: str, members: int) -> dict:
        """Ack plans (as the coordinator would) until one over ``members`` pods is applied."""
        def check():
            status = self.status(name)
            plan = status.get("plan")
            if not plan:
                return None
            if status.get("appliedGeneration", 0) < plan["generation"]:
                self.patch_status(name, {"appliedGeneration": plan["generation"]})
                return None
            return len(plan["members"]) == members and status.get("phase") == "Running" and plan
        return wait_for(check, timeout=30, what=f"an applied plan over {members} pods")

    def exit_cleanly(self, pod: str) -> None:
        """The worker's process ends on its own with 0 (a leaver after commit, the last step)."""
        os.kill(self.agent.procs[(self.ns, pod)].proc.pid, signal.SIGTERM)

    def events(self, name: str) -> dict[str, str]:
        return {e.reason: e.message for e in self.core.list_namespaced_event(self.ns).items
                if e.involved_object.name == name}


@pytest.fixture
def jobs(kube, tmp_path, request):
    """Three 1-GPU nodes and the operator, watching a namespace of this test's own."""
    j = Jobs(kube, tmp_path, request.node.name.replace("_", "-")[5:30].strip("-"), nodes=3)
    yield j
    j.stop()


@pytest.mark.slow
def test_workers_that_all_exit_on_the_same_bad_input_fail_the_job_with_their_message(jobs):
    jobs.create("cfg", 3, f"echo reading the spec; echo '{BAD_INPUT}' >&2; exit 2")
    status = wait_for(lambda: (s := jobs.status("cfg")).get("phase") == "Failed" and s, timeout=60,
                      what="the job Failed")
    assert status["message"].startswith(BAD_INPUT), status["message"]
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "WorkerConfigError"
    assert status["tracking"]["configError"]["message"] == BAD_INPUT and status["tracking"]["configError"]["count"] >= 3
    assert wait_for(lambda: jobs.events("cfg").get("WorkerConfigError"), what="the event").startswith(BAD_INPUT)
    # nothing runs or waits (the coordinator is gone); nothing is re-created
    wait_for(lambda: all(p == "Failed" for p in jobs.phases().values()), what="only failed pods left")
    time.sleep(1.0)
    assert all(p == "Failed" for p in jobs.phases().values()), jobs.phases()
    assert jobs.status("cfg")["phase"] == "Failed"


@pytest.mark.slow
def test_a_job_grows_back_when_the_taint_goes_and_leaves_nothing_running_once_succeeded(jobs):
    # SIGTERM ends a worker with 0, as a leaver's or a finished worker's process ends
    jobs.create("grow", 3, "trap 'exit 0' TERM; sleep 600 & wait")
    jobs.acked("grow", 3)
    victim = jobs.pods()["grow-worker-1"]
    node, old_uid = victim.spec.node_name, victim.metadata.uid

    # a spot notice: the plan leaves worker-1 out, its process ends cleanly, the runtime acks
    jobs.agent.taint(node)
    wait_for(lambda: "grow-worker-1" not in jobs.status("grow")["plan"]["members"], what="a plan without worker-1")
    jobs.exit_cleanly("grow-worker-1")
    jobs.acked("grow", 2)
    # its replacement (same name, new pod) waits for capacity: the tainted node was the last free one
    replacement = wait_for(lambda: (p := jobs.pods().get("grow-worker-1")) is not None
                           and p.metadata.uid != old_uid and p, what="the replacement pod")
    time.sleep(0.5)
    assert jobs.pods()["grow-worker-1"].status.phase == "Pending" and not jobs.pods()["grow-worker-1"].spec.node_name

    # the taint goes: the replacement is scheduled there, runs, and the job grows back to 3
    jobs.core.patch_node(node, {"spec": {"taints": None}})
    plan = jobs.acked("grow", 3)
    assert "grow-worker-1" in plan["members"] and plan["reason"].startswith("scale-up")
    running = jobs.pods()["grow-worker-1"]
    assert running.metadata.uid == replacement.metadata.uid and running.spec.node_name == node
    assert running.status.phase == "Running"

    # the run ends: a worker's process exits 0 first and the operator re-creates its pod before it
    # reads the end; then the coordinator reports it
    old = jobs.pods()["grow-worker-0"].metadata.uid
    jobs.exit_cleanly("grow-worker-0")
    wait_for(lambda: (p := jobs.pods().get("grow-worker-0")) is not None and p.metadata.uid != old,
             what="worker-0 re-created")
    # (it ended a grace period ago: the unit tests check that running workers get that long)
    ended = datetime.now(UTC) - timedelta(seconds=FINISHED_WORKER_GRACE_SECONDS)
    jobs.patch_status("grow", Finished(ended, 1000, "/ckpt/step00001000").to_status())
    wait_for(lambda: jobs.status("grow").get("phase") == "Succeeded", what="Succeeded")
    # every pod still running or pending goes (the coordinator, the re-created worker too)
    wait_for(lambda: all(p in ("Succeeded", "Failed") for p in jobs.phases().values()), timeout=30,
             what=f"nothing running or pending: {jobs.phases()}")
    time.sleep(1.0)
    assert all(p in ("Succeeded", "Failed") for p in jobs.phases().values()), jobs.phases()
    assert jobs.status("grow")["phase"] == "Succeeded"
