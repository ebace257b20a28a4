"""The real operator (kopf, in a thread) against the API emulator, over HTTP.

A test plays scheduler and kubelet (``run_pod`` binds and starts a pod, ``Kubelet`` finishes the
pods that are deleted with a grace period) and the runtime's coordinator (it acks plans by
patching ``status.appliedGeneration``), and checks what the operator does in between.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import kubernetes.client as k8s
import pytest

from liveshard.dev.localcluster.emulator import KubeEmulator, finish_terminating_pods, run_pod
from liveshard.dev.ports import free_port
from liveshard.operator import metrics
from liveshard.operator.command import run_operator
from liveshard.operator.options import Options
from liveshard.operator.signals import parse_time
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

NS = "default"

SPOT_ITN = {"key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-0f1e2d3c", "effect": "NoSchedule"}


class Operator:
    """``liveshard operator`` in a background thread (kopf cannot share pytest's event loop)."""

    def __init__(self, url: str, liveness: str | None = None, namespaces: tuple[str, ...] = ()) -> None:
        self.options = Options(server=url, metrics_port=None, liveness=liveness, namespaces=namespaces)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.thread = threading.Thread(target=run_operator, name="operator", daemon=True,
                                       args=(self.options, self.stop_flag, self.ready_flag))

    def start(self) -> Operator:
        self.thread.start()
        assert self.ready_flag.wait(30), "the operator did not start"
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the operator did not stop"


class Kubelet:
    """The nodes' kubelets, as far as deletion goes: a bound pod deleted with a grace period stays
    Terminating until its kubelet deletes it again with grace 0 (the pods here run nothing)."""

    def __init__(self, kube: KubeEmulator) -> None:
        self.core = k8s.CoreV1Api(kube.api_client())
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kubelet", daemon=True)

    def _run(self) -> None:
        while not self.stop_flag.wait(0.05):
            try:
                finish_terminating_pods(self.core, NS)
            except Exception:  # the emulator is stopping
                return

    def __enter__(self) -> Kubelet:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(10)


class Cluster:
    def __init__(self, kube: KubeEmulator) -> None:
        api = kube.api_client()
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.rbac = k8s.RbacAuthorizationV1Api(api)
        self.net = k8s.NetworkingV1Api(api)

    def add_nodes(self, *names: str, gpu_mib: int = 81559) -> None:
        for name in names:
            self.core.create_node({"metadata": {"name": name, "labels": {"nvidia.com/gpu.memory": str(gpu_mib)}},
                                   "status": {"conditions": [{"type": "Ready", "status": "True"}]}})

    def create_job(self, name: str, workers: dict, field_validation: str | None = None, **spec) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ElasticTrainingJob",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"model": {"preset": "gpt-125m"}, "image": "ghcr.io/example/train:1",
                         "workers": workers, "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 64},
                         "elasticity": {"scaleUpCooldownSeconds": 1}, **spec}}
        extra = {"field_validation": field_validation} if field_validation else {}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body, **extra)

    def job(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def ack(self, name: str) -> int:
        gen = self.status(name)["plan"]["generation"]
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, name,
                                                          {"status": {"appliedGeneration": gen}})
        return gen

    def pods(self, job: str) -> dict[str, k8s.V1Pod]:
        return {p.metadata.name: p for p in self.core.list_namespaced_pod(NS).items
                if (p.metadata.labels or {}).get("liveshard.io/job") == job}

    def workers(self, job: str) -> dict[str, k8s.V1Pod]:
        return {n: p for n, p in self.pods(job).items() if p.metadata.labels.get("liveshard.io/role") == "worker"}

    def schedule(self, job: str, nodes: list[str]) -> None:
        """Bind every pending worker pod of ``job`` to a free node of ``nodes`` and start it."""
        used = {p.spec.node_name for p in self.workers(job).values() if p.spec.node_name}
        free = [n for n in nodes if n not in used]
        for name, pod in sorted(self.workers(job).items()):
            if not pod.spec.node_name and free:
                run_pod(self.core, NS, name, free.pop(0))


def wait_for(check, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.03)


@pytest.fixture(scope="module")
def cluster(kube):
    operator = Operator(kube.url).start()
    with Kubelet(kube):
        yield Cluster(kube)
    operator.stop()


def start_running(cluster: Cluster, job: str, nodes: list[str], workers: dict, **spec) -> dict:
    """Create the job, run its pods, and ack plans until one with every pod is running."""
    count = workers.get("replicas", workers["max"])
    cluster.add_nodes(*nodes)
    cluster.create_job(job, workers, **spec)
    wait_for(lambda: len(cluster.workers(job)) == count, what="worker pods")
    cluster.schedule(job, nodes)

    def running_on_all():
        status = cluster.status(job)
        plan = status.get("plan")
        if not plan:
            return None
        if status.get("appliedGeneration", 0) < plan["generation"]:
            cluster.ack(job)  # an early plan may cover fewer pods: a scale-up follows
            return None
        return status.get("phase") == "Running" and len(plan["members"]) == count and plan

    return wait_for(running_on_all, what=f"a running plan over {count} pods")


def next_plan(cluster: Cluster, job: str, after: int) -> dict:
    return wait_for(lambda: (p := cluster.status(job)["plan"])["generation"] > after and p,
                    what=f"a plan after generation {after}")


# ---- create -----------------------------------------------------------------------------------
def test_a_job_gets_its_pods_coordinator_service_policy_and_rbac(cluster):
    cluster.create_job("alpha", {"min": 1, "max": 3, "gpusPerWorker": 2})
    pods = wait_for(lambda: (p := cluster.pods("alpha")) and len(p) == 4 and p, what="pods")
    uid = cluster.job("alpha")["metadata"]["uid"]
    assert sorted(pods) == ["alpha-coordinator", "alpha-worker-0", "alpha-worker-1", "alpha-worker-2"]
    worker = pods["alpha-worker-1"]
    assert worker.metadata.owner_references[0].uid == uid and worker.metadata.owner_references[0].controller
    assert worker.metadata.labels["liveshard.io/worker-index"] == "1"
    assert worker.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
    assert worker.spec.subdomain == "alpha" and worker.spec.restart_policy == "Never"
    coord = pods["alpha-coordinator"]
    terms = coord.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert {"karpenter.sh/capacity-type", "cloud.google.com/gke-spot"} <= {e.key for e in terms[0].match_expressions}

    svc = wait_for(lambda: _get(cluster.core.read_namespaced_service, "alpha"), what="service")
    assert svc.spec.cluster_ip == "None" and svc.spec.selector == {"liveshard.io/job": "alpha"}
    policy = cluster.net.read_namespaced_network_policy("alpha-coordinator", NS)
    assert policy.spec.pod_selector.match_labels["liveshard.io/role"] == "coordinator"
    assert policy.spec.ingress[0]._from[0].pod_selector.match_labels == {"liveshard.io/job": "alpha"}
    assert policy.spec.policy_types == ["Ingress", "Egress"]
    workers_policy = cluster.net.read_namespaced_network_policy("alpha-workers", NS)
    assert [p.to[0].pod_selector.match_labels for p in workers_policy.spec.egress if p.to and p.to[0].pod_selector
            and not p.to[0].namespace_selector] == [{"liveshard.io/job": "alpha"}]
    role = cluster.rbac.read_namespaced_role("alpha-coordinator", NS)
    assert all(rule.resource_names == ["alpha"] for rule in role.rules)
    assert {"elastictrainingjobs/status"} == {r for rule in role.rules if "patch" in rule.verbs for r in rule.resources}
    # the coordinator's account is bound to the Role; the workers' account to nothing
    binding = cluster.rbac.read_namespaced_role_binding("alpha-coordinator", NS)
    assert [s.name for s in binding.subjects] == ["alpha-coordinator"] and binding.role_ref.name == "alpha-coordinator"
    assert coord.spec.service_account_name == "alpha-coordinator"
    assert worker.spec.service_account_name == "alpha-worker" and worker.spec.automount_service_account_token is False
    assert cluster.core.read_namespaced_service_account("alpha-worker", NS).automount_service_account_token is False
    bound = {s.name for b in cluster.rbac.list_namespaced_role_binding(NS).items for s in b.subjects or ()}
    assert "alpha-worker" not in bound

    # replicas counts the worker pods that exist: the reconcile after they were created says 3
    status = wait_for(lambda: (s := cluster.status("alpha")).get("replicas") == 3 and s, what="status replicas")
    assert status["phase"] == "Pending"
    assert status["selector"] == "liveshard.io/job=alpha,liveshard.io/role=worker"


def _get(fn, name):
    try:
        return fn(name, NS)
    except k8s.ApiException as e:
        if e.status == 404:
            return None
        raise


# ---- spot notice ------------------------------------------------------------------------------
def test_spot_taint_replans_within_the_notice_and_the_ack_removes_the_pod(cluster):
    nodes = ["spot-a", "spot-b", "spot-c", "spot-d"]
    first = start_running(cluster, "bravo", nodes, {"min": 1, "max": 4, "gpusPerWorker": 1})
    assert len(first["members"]) == 4
    victim = cluster.workers("bravo")["bravo-worker-2"].spec.node_name
    replans_before = metrics.REPLANS.labels("spot-interruption")._value.get()
    notices_before = _histogram_count(metrics.NOTICE_TO_PLAN)

    tainted_at = time.time()
    cluster.core.patch_node(victim, {"spec": {"unschedulable": True, "taints": [SPOT_ITN]}})
    plan = next_plan(cluster, "bravo", first["generation"])
    seen = time.time() - tainted_at

    assert "bravo-worker-2" not in plan["members"] and plan["leaving"] == ["bravo-worker-2"]
    assert plan["reason"].startswith("spot-interruption")
    created, deadline = parse_time(plan["createdAt"]), parse_time(plan["deadline"])
    assert created < deadline and 110 < (deadline - created).total_seconds() <= 120  # the 2-minute notice
    assert seen < 5.0, f"plan took {seen:.2f}s"
    # the handler counts the plan right after writing it: the test may see the plan first
    wait_for(lambda: metrics.REPLANS.labels("spot-interruption")._value.get() == replans_before + 1,
             timeout=5, what="the replan counted")
    wait_for(lambda: _histogram_count(metrics.NOTICE_TO_PLAN) == notices_before + 1, timeout=5,
             what="the notice-to-plan time observed")

    time.sleep(0.5)  # nothing is deleted before the runtime acks
    assert "bravo-worker-2" in cluster.workers("bravo")
    assert cluster.status("bravo")["phase"] == "Reconfiguring"

    cluster.ack("bravo")
    wait_for(lambda: cluster.status("bravo")["phase"] == "Running", what="Running after the ack")
    # deleted, then recreated under the same stable name, waiting for capacity
    wait_for(lambda: (p := cluster.workers("bravo").get("bravo-worker-2")) is not None and not p.spec.node_name,
             what="replacement pod")
    status = cluster.status("bravo")
    assert status["history"][-1]["outcome"] == "Applied" and status["worldSize"] == len(plan["members"])
    assert "failures" not in status  # a preemption is not a failure
    reasons = {e.reason for e in cluster.core.list_namespaced_event(NS).items
               if e.involved_object.name == "bravo"}
    assert {"Replanned", "Reconfigured", "WorkerRemoved"} <= reasons


def _histogram_count(hist) -> float:
    return next(s.value for m in hist.collect() for s in m.samples if s.name.endswith("_count"))


# ---- scale ------------------------------------------------------------------------------------
def test_kubectl_scale_down_and_back_up(cluster):
    nodes = ["pool-a", "pool-b", "pool-c", "pool-d"]
    first = start_running(cluster, "charlie", nodes, {"min": 1, "max": 4, "gpusPerWorker": 1})

    scale = cluster.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, PLURAL, "charlie",
                                                                {"spec": {"replicas": 2}})
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"].startswith("liveshard.io/job=charlie")
    plan = next_plan(cluster, "charlie", first["generation"])
    assert sorted(plan["leaving"]) == ["charlie-worker-2", "charlie-worker-3"]
    assert plan["reason"].startswith("scale-down")
    cluster.ack("charlie")
    wait_for(lambda: sorted(cluster.workers("charlie")) == ["charlie-worker-0", "charlie-worker-1"],
             what="pods 2 and 3 gone")
    assert cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, NS, PLURAL, "charlie")[
        "status"]["replicas"] == 2

    cluster.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, PLURAL, "charlie",
                                                        {"spec": {"replicas": 4}})
    wait_for(lambda: len(cluster.workers("charlie")) == 4, what="new pods")
    cluster.schedule("charlie", nodes)
    plan = next_plan(cluster, "charlie", plan["generation"])
    assert plan["reason"].startswith("scale-up") and len(plan["members"]) == 4
    assert sorted(plan["joining"]) == ["charlie-worker-2", "charlie-worker-3"]

    with pytest.raises(k8s.ApiException) as e:
        cluster.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NS, PLURAL, "charlie",
                                                            {"spec": {"replicas": 9}})
    assert e.value.status == 422 and "workers.replicas must lie within" in e.value.body


# ---- bad input --------------------------------------------------------------------------------
def test_invalid_manifests_are_refused_with_readable_messages(cluster):
    with pytest.raises(k8s.ApiException) as e:
        cluster.create_job("delta", {"min": 5, "max": 2})
    body = json.loads(e.value.body)
    assert e.value.status == 422
    assert body["message"] == ('ElasticTrainingJob.liveshard.io "delta" is invalid: '
                               'spec.workers: Invalid value: "object": workers.min must be <= workers.max')
    # an unknown field: refused under Strict field validation (what kubectl apply asks for), pruned
    # with a warning otherwise, as a real server does
    with pytest.raises(k8s.ApiException) as e:
        cluster.create_job("delta", {"max": 2, "gpuPerWorker": 8}, field_validation="Strict")
    assert e.value.status == 400
    assert 'unknown field "spec.workers.gpuPerWorker"' in json.loads(e.value.body)["message"]


def test_a_spec_only_the_operator_can_reject_fails_the_job_with_the_reason(cluster):
    cluster.create_job("echo", {"max": 2, "gpusPerWorker": 1}, parallelism={"ep": [2]})
    status = wait_for(lambda: (s := cluster.status("echo")).get("phase") == "Failed" and s, what="Failed")
    assert status["message"].startswith("spec.parallelism.ep: [2] on a dense model")
    assert not cluster.workers("echo")


# ---- failures -----------------------------------------------------------------------------------
def test_a_worker_crash_beyond_the_budget_fails_the_job_and_releases_its_pods(cluster):
    start_running(cluster, "golf", ["crash-a", "crash-b"], {"min": 1, "max": 2, "gpusPerWorker": 1},
                  elasticity={"scaleUpCooldownSeconds": 1, "maxPodFailures": 0})
    cluster.core.patch_namespaced_pod_status("golf-worker-1", NS, {"status": {
        "phase": "Failed", "reason": "Error", "message": "container exited with code 1"}})
    status = wait_for(lambda: (s := cluster.status("golf")).get("phase") == "Failed" and s, what="Failed")
    assert status["podFailures"] == 1 and "maxPodFailures=0" in status["message"]
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "PodFailureBudgetExceeded"
    # the running worker and the coordinator are deleted; the failed pod stays for its logs
    wait_for(lambda: sorted(cluster.pods("golf")) == ["golf-worker-1"], what="only the failed pod left")
    reasons = {e.reason for e in cluster.core.list_namespaced_event(NS).items if e.involved_object.name == "golf"}
    assert "PodFailureBudgetExceeded" in reasons
    time.sleep(0.5)  # and nothing is created again
    assert sorted(cluster.pods("golf")) == ["golf-worker-1"]


def test_a_host_path_checkpoint_is_refused_unless_the_operator_allows_it(cluster):
    cluster.create_job("hotel", {"max": 2, "gpusPerWorker": 1},
                       checkpoint={"path": "/ckpt", "volume": {"hostPath": {"path": "/mnt/ckpt"}}})
    status = wait_for(lambda: (s := cluster.status("hotel")).get("phase") == "Failed" and s, what="Failed")
    assert status["message"].startswith("spec.checkpoint.volume.hostPath:")
    assert "--allow-host-path-checkpoints" in status["message"]
    assert not cluster.pods("hotel")


# ---- restart ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_operator_restarted_mid_reconfiguration_finishes_it_from_the_status(tmp_path, crd_path):
    with KubeEmulator(crds=[crd_path]) as kube, Kubelet(kube):
        cluster = Cluster(kube)
        first = Operator(kube.url).start()
        try:
            first_plan = start_running(cluster, "foxtrot", ["r-a", "r-b", "r-c"],
                                       {"min": 1, "max": 3, "gpusPerWorker": 1})
            cluster.core.patch_node("r-b", {"spec": {"taints": [SPOT_ITN]}})
            plan = next_plan(cluster, "foxtrot", first_plan["generation"])
        finally:
            first.stop()
        leaving = plan["leaving"]
        assert leaving and all(name in cluster.workers("foxtrot") for name in leaving)

        port = free_port()
        # the second one watches only the job's namespace (liveshard operator -n default)
        second = Operator(kube.url, liveness=f"http://127.0.0.1:{port}/healthz", namespaces=(NS,)).start()
        try:
            time.sleep(1.5)  # let it settle: it must not plan again nor delete before the ack
            status = cluster.status("foxtrot")
            assert status["plan"] == plan and status["phase"] == "Reconfiguring"
            assert all(name in cluster.workers("foxtrot") for name in leaving)
            probe = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
            assert probe["jobs"] == 1

            cluster.ack("foxtrot")
            def leaver_on_r_b() -> bool:
                workers = cluster.workers("foxtrot")  # one read: a pod may go between two
                return any(name in workers and workers[name].spec.node_name == "r-b" for name in leaving)

            wait_for(lambda: not leaver_on_r_b(), what="leaving pod deleted by the restarted operator")
            status = wait_for(lambda: (s := cluster.status("foxtrot"))["phase"] == "Running" and s)
            assert status["plan"]["generation"] == plan["generation"]
            assert status["history"][-1]["outcome"] == "Applied"
        finally:
            second.stop()




# ---- one authority per event ------------------------------------------------------------------
def commit(cluster: Cluster, name: str, runtime_generation: int) -> dict:
    """Play the coordinator committing the job's current plan: the world it runs, then the ack
    (``kube_source`` writes them in that order)."""
    plan = cluster.status(name)["plan"]
    world = {"generation": runtime_generation, "config": plan["config"], "members": plan["members"],
             "worldSize": plan["worldSize"], "planGeneration": plan["generation"]}
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, name, {"status": {"world": world}})
    cluster.ack(name)
    return plan


def test_a_node_lost_without_notice_shows_the_runtimes_world_and_the_standby_takes_over(cluster):
    """kubectl delete node under a worker. The runtime recovers on its own (it sees the loss
    first): the operator plans nothing for the loss, the status shows the world the runtime
    committed as soon as it is reported, and the job, now below minDataParallel with a pod
    standing by, grows back with it at once (no scale-up cooldown)."""
    nodes = ["kilo-a", "kilo-b", "kilo-c"]
    cluster.add_nodes(*nodes)
    cluster.create_job("kilo", {"min": 1, "max": 3, "gpusPerWorker": 1},
                       parallelism={"minDataParallel": 2, "distributedOptimizer": False},
                       elasticity={"scaleUpCooldownSeconds": 300})
    wait_for(lambda: len(cluster.workers("kilo")) == 3, what="worker pods")
    cluster.schedule("kilo", nodes)
    first = wait_for(lambda: cluster.status("kilo").get("plan"), what="a first plan")
    assert len(first["members"]) == 2 and ",dp=2," in first["config"]  # the third stands by
    commit(cluster, "kilo", 0)
    wait_for(lambda: (s := cluster.status("kilo")).get("phase") == "Running" and s["worldSize"] == 2, what="Running")
    lost, kept = first["members"][1], first["members"][0]
    standby = next(n for n in cluster.workers("kilo") if n not in first["members"])

    cluster.core.delete_node(cluster.workers("kilo")[lost].spec.node_name)
    time.sleep(1.5)  # the operator has seen it: it must plan nothing (the runtime's loss)
    assert cluster.status("kilo")["plan"]["generation"] == first["generation"]

    dp1 = first["config"].replace("dp=2", "dp=1")
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "kilo", {"status": {"world": {
        "generation": 1, "config": dp1, "members": [kept], "worldSize": 1, "planGeneration": None,
        "cause": "lost-without-notice", "reason": f"lost {lost}/0 without notice"}}})
    regrow = wait_for(lambda: (s := cluster.status("kilo"))["plan"]["generation"] > first["generation"] + 1 and s,
                      what="the recovery recorded and a grow-back plan")
    assert regrow["worldSize"] == 1  # the world that runs, never the plan that was acked
    observed = next(h for h in regrow["history"] if h.get("outcome") == "Observed")
    assert observed["runtimeGeneration"] == 1 and observed["to"] == dp1 and observed["worldSize"] == 1
    plan = regrow["plan"]
    assert plan["cause"] == "scale-up" and plan["members"] == [kept, standby] and ",dp=2," in plan["config"]
    assert plan["memberUids"][standby] == cluster.workers("kilo")[standby].metadata.uid
    def lost_gone() -> bool:
        pod = cluster.workers("kilo").get(lost)  # one read: the pod may go between two
        return pod is None or pod.spec.node_name is None

    wait_for(lost_gone, what="the lost pod deleted (it is in no world)")

    commit(cluster, "kilo", 2)
    done = wait_for(lambda: (s := cluster.status("kilo")).get("phase") == "Running" and s["worldSize"] == 2 and s,
                    what="Running on dp=2 again")
    assert done["history"][-1]["outcome"] == "Applied" and done["world"]["members"] == [kept, standby]
