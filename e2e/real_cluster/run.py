#!/usr/bin/env python3
"""Real-cluster end-to-end check of liveshard: a spot notice on a node moves the job off it live.

Against the cluster of the current kubeconfig context (kind for CPU, or any GPU cluster):

1. installs (or upgrades) the Helm chart ``helm/liveshard``;
2. applies a job (default ``examples/tiny-cpu.yaml``) and waits until its first plan is applied
   and every member pod runs;
3. taints the node of one member the way AWS Node Termination Handler
   (``aws-node-termination-handler/spot-itn=<id>:NoSchedule``) or Karpenter
   (``karpenter.sh/disrupted:NoSchedule``) does on a spot interruption notice;
4. asserts: a new plan (higher generation) leaves out every pod on that node; the runtime acks it
   (``status.appliedGeneration`` reaches it); the members that stay keep their pods (same UIDs,
   no container restarts); and training steps keep advancing afterwards.

Exit status 0 only if every check passed; each failed check is printed as one line. Needs
``kubectl`` and ``helm`` on PATH. Nothing here is simulated: it talks to whatever cluster the
context points at, so run it only against a cluster you may taint.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TAINTS = {
    # (key, value or None, effect): exactly what each tool writes on a spot interruption.
    "nth": ("aws-node-termination-handler/spot-itn", "e2e-{id}", "NoSchedule"),
    "karpenter": ("karpenter.sh/disrupted", None, "NoSchedule"),
}
DEFAULT_STEP_PATTERN = r"\bstep[ =:]+(\d+)"


class CheckFailed(Exception):
    """One line saying which expectation did not hold."""


# ---- arguments --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="e2e/real_cluster/run.py",
        description="Install liveshard on a real cluster, taint a node of a running job like a spot "
                    "notice, and check that the job reconfigures live and keeps training.",
    )
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--namespace", default="default", help="namespace of the job")
    p.add_argument("--operator-namespace", default="liveshard-system", help="namespace of the Helm release")
    p.add_argument("--release", default="liveshard", help="Helm release name")
    p.add_argument("--chart", default=str(ROOT / "helm" / "liveshard"), help="chart directory")
    p.add_argument("--operator-image", default="liveshard/operator:dev",
                   help="operator image as REPOSITORY:TAG (for kind: the image you `kind load`ed)")
    p.add_argument("--job", default=str(ROOT / "examples" / "tiny-cpu.yaml"), help="ElasticTrainingJob manifest")
    p.add_argument("--worker-image", help="override the job's spec.image (e.g. liveshard/worker:cpu)")
    p.add_argument("--signal", choices=sorted(TAINTS), default="nth",
                   help="whose spot-notice taint to apply: AWS NTH or Karpenter")
    p.add_argument("--fake-gpus", type=int, default=0, metavar="N",
                   help="advertise N nvidia.com/gpu on every schedulable node first (CPU clusters such as "
                        "kind; the extended resource is only bookkeeping there)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the first applied plan")
    p.add_argument("--reconfigure-timeout", type=float, default=600.0,
                   help="seconds to wait for the plan that excludes the tainted node to be applied")
    p.add_argument("--steps-after", type=int, default=3,
                   help="training steps that must follow the reconfiguration")
    p.add_argument("--step-pattern", default=DEFAULT_STEP_PATTERN,
                   help="regex with one group: the step number in the pods' logs")
    p.add_argument("--keep", action="store_true", help="leave the job, taint and release in place afterwards")
    p.add_argument("--dry-run", action="store_true", help="print the commands that would change the cluster")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fake_gpus < 0:
        parser.error("--fake-gpus: must be >= 0")
    if args.steps_after < 1:
        parser.error("--steps-after: must be >= 1")
    if args.ready_timeout <= 0 or args.reconfigure_timeout <= 0:
        parser.error("--ready-timeout/--reconfigure-timeout: must be positive seconds")
    try:
        pattern = re.compile(args.step_pattern)
    except re.error as e:
        parser.error(f"--step-pattern: not a regular expression ({e})")
    if pattern.groups != 1:
        parser.error("--step-pattern: needs exactly one group, the step number")
    if ":" not in args.operator_image.rpartition("/")[2]:
        parser.error("--operator-image: give REPOSITORY:TAG, e.g. liveshard/operator:dev")
    if not Path(args.job).is_file():
        parser.error(f"--job: {args.job} does not exist")
    return args


# ---- pure checks ------------------------------------------------------------------------------


def taint_args(signal: str, run_id: str) -> str:
    """The ``kubectl taint`` argument for a signal, e.g. ``karpenter.sh/disrupted:NoSchedule``."""
    key, value, effect = TAINTS[signal]
    return f"{key}={value.format(id=run_id)}:{effect}" if value else f"{key}:{effect}"


def taint_object(signal: str, run_id: str) -> dict[str, str]:
    key, value, effect = TAINTS[signal]
    out = {"key": key, "effect": effect}
    if value:
        out["value"] = value.format(id=run_id)
    return out


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    node: str
    phase: str
    restarts: int


def pod_state(pod: dict[str, Any]) -> PodState:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return PodState(pod["metadata"]["name"], pod["metadata"]["uid"], (pod.get("spec") or {}).get("nodeName") or "",
                    (pod.get("status") or {}).get("phase") or "", sum(int(s.get("restartCount", 0)) for s in statuses))


def check_reconfiguration(before: dict[str, PodState], plan_before: dict[str, Any], plan_after: dict[str, Any],
                          applied: int, after: dict[str, PodState], tainted_node: str) -> list[str]:
    """Every expectation about the switch that did not hold, one line each."""
    problems = []
    gen0, gen1 = int(plan_before.get("generation") or 0), int(plan_after.get("generation") or 0)
    if gen1 <= gen0:
        problems.append(f"no new plan: generation stayed {gen0}")
    leaving = {n for n in plan_before.get("members") or [] if n in before and before[n].node == tainted_node}
    if not leaving:
        problems.append(f"no member of plan {gen0} ran on the tainted node {tainted_node}")
    members = list(plan_after.get("members") or [])
    on_tainted = [m for m in members if m in before and before[m].node == tainted_node]
    if on_tainted:
        problems.append(f"plan {gen1} still uses pods on the tainted node: {', '.join(on_tainted)}")
    if not members:
        problems.append(f"plan {gen1} has no members (the job suspended): reason {plan_after.get('reason')!r}")
    if applied < gen1:
        problems.append(f"status.appliedGeneration is {applied}, not {gen1}")
    # Every pod not on the tainted node stays: same pod, no container restart.
    for name, old in sorted(before.items()):
        if old.node == tainted_node:
            continue
        new = after.get(name)
        if new is None:
            problems.append(f"pod {name} (not on the tainted node) is gone")
        elif new.uid != old.uid:
            problems.append(f"pod {name} was replaced (uid {old.uid} -> {new.uid})")
        elif new.restarts != old.restarts:
            problems.append(f"pod {name} restarted ({old.restarts} -> {new.restarts} container restarts)")
        elif new.phase != "Running":
            problems.append(f"pod {name} is {new.phase}")
    return problems


def last_step(logs: str, pattern: str) -> int | None:
    steps = [int(m.group(1)) for m in re.finditer(pattern, logs)]
    return max(steps) if steps else None


# ---- cluster ----------------------------------------------------------------------------------


class Cluster:
    """kubectl and helm against one context; ``dry_run`` prints the writes instead of doing them."""

    def __init__(self, context: str | None, dry_run: bool, log: Callable[[str], None] = print) -> None:
        self.context = context
        self.dry_run = dry_run
        self.log = log

    def _ctx(self, tool: str) -> list[str]:
        if not self.context:
            return []
        return ["--context", self.context] if tool == "kubectl" else ["--kube-context", self.context]

    def run(self, tool: str, *args: str, write: bool = False, stdin: str | None = None) -> str:
        cmd = [tool, *self._ctx(tool), *args]
        if write and self.dry_run:
            self.log("would run: " + " ".join(cmd))
            return ""
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
        if done.returncode:
            raise CheckFailed(f"{' '.join(cmd[:4])} ... failed: {done.stderr.strip()[:500]}")
        return done.stdout

    def kubectl_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.run("kubectl", *args, "-o", "json"))


def wait_for(what: str, timeout: float, probe: Callable[[], Any], interval: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def job_status(c: Cluster, ns: str, name: str) -> dict[str, Any]:
    return c.kubectl_json("-n", ns, "get", "elastictrainingjobs.liveshard.io", name).get("status") or {}


def job_pods(c: Cluster, ns: str, name: str) -> dict[str, PodState]:
    pods = c.kubectl_json("-n", ns, "get", "pods", "-l", f"liveshard.io/job={name},liveshard.io/role=worker")
    return {p.name: p for p in map(pod_state, pods["items"])}


def training_step(c: Cluster, ns: str, pods: Sequence[str], pattern: str) -> int | None:
    steps = [last_step(c.run("kubectl", "-n", ns, "logs", "--tail=200", pod), pattern) for pod in pods]
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("kubectl", "helm"):
        if shutil.which(tool) is None and not args.dry_run:
            print(f"error: {tool} is not on PATH", file=sys.stderr)
            return 2
    c = Cluster(args.context, args.dry_run)
    run_id = uuid.uuid4().hex[:8]
    from liveshard.runtime.commands.training_args import read_job_file

    job = read_job_file(args.job).raw  # the CLI's bounded loader: size and YAML aliases
    name, ns = job["metadata"]["name"], args.namespace
    job["metadata"]["namespace"] = ns
    if args.worker_image:
        job["spec"]["image"] = args.worker_image
    tainted = None
    try:
        if args.fake_gpus and args.dry_run:
            print(f"would advertise nvidia.com/gpu={args.fake_gpus} on every schedulable node")
        elif args.fake_gpus:
            for node in c.kubectl_json("get", "nodes")["items"]:
                if not node["spec"].get("unschedulable"):
                    c.run("kubectl", "patch", "node", node["metadata"]["name"], "--subresource=status",
                          "--type=json", "-p", json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu",
                                                            "value": str(args.fake_gpus)}]), write=True)
        repo, _, tag = args.operator_image.rpartition(":")
        c.run("helm", "upgrade", "--install", args.release, args.chart, "--namespace", args.operator_namespace,
              "--create-namespace", "--wait", "--timeout", "5m", "--set", f"image.repository={repo}",
              "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent", write=True)
        c.run("kubectl", "apply", "-f", "-", write=True, stdin=json.dumps(job))
        if args.dry_run:
            print("would taint a member's node: kubectl taint node NODE " + taint_args(args.signal, run_id))
            return 0

        def first_plan_running() -> Any:
            status = job_status(c, ns, name)
            plan = status.get("plan") or {}
            gen, members = int(plan.get("generation") or 0), plan.get("members") or []
            if not gen or int(status.get("appliedGeneration") or 0) < gen or not members:
                return None
            pods = job_pods(c, ns, name)
            if all(m in pods and pods[m].phase == "Running" for m in members):
                return plan, pods
            return None

        plan0, pods0 = wait_for(f"job {ns}/{name} to apply its first plan", args.ready_timeout, first_plan_running)
        print(f"plan {plan0['generation']} applied: {plan0['config']} on {', '.join(plan0['members'])}")
        step0 = wait_for("a training step in the workers' logs", 300,
                         lambda: training_step(c, ns, plan0["members"], args.step_pattern))
        # The last member's node: with a fresh job that is the one the scheduler filled last.
        tainted = pods0[plan0["members"][-1]].node
        c.run("kubectl", "taint", "node", tainted, taint_args(args.signal, run_id), write=True)
        print(f"tainted node {tainted}: {taint_args(args.signal, run_id)} (step {step0})")

        def replanned() -> Any:
            status = job_status(c, ns, name)
            plan = status.get("plan") or {}
            if int(plan.get("generation") or 0) <= int(plan0["generation"]):
                return None
            if int(status.get("appliedGeneration") or 0) < int(plan["generation"]):
                return None
            return plan, int(status["appliedGeneration"])

        plan1, applied = wait_for("a plan without the tainted node to be applied", args.reconfigure_timeout, replanned)
        print(f"plan {plan1['generation']} applied: {plan1['config']} on {', '.join(plan1['members'])} "
              f"({plan1.get('reason', '')})")
        problems = check_reconfiguration(pods0, plan0, plan1, applied, job_pods(c, ns, name), tainted)
        survivors = [m for m in plan1["members"] if m in pods0]
        step1 = training_step(c, ns, survivors, args.step_pattern) or 0
        try:
            wait_for(f"{args.steps_after} more steps after the switch", 300,
                     lambda: (training_step(c, ns, survivors, args.step_pattern) or 0) >= step1 + args.steps_after)
        except CheckFailed as e:
            problems.append(str(e))
        for line in problems:
            print(f"FAIL: {line}")
        print("PASS" if not problems else f"{len(problems)} check(s) failed")
        return 0 if not problems else 1
    except CheckFailed as e:
        print(f"FAIL: {e}")
        return 1
    finally:
        if not args.keep and not args.dry_run:
            cleanup(c, args.signal, tainted, ns, name)


def cleanup(c: Cluster, signal: str, tainted: str | None, ns: str, name: str) -> None:
    """Untaint the node and delete the job (the release stays: reinstalling it is slow)."""
    key, _, effect = TAINTS[signal]
    steps = [("kubectl", "-n", ns, "delete", "elastictrainingjobs.liveshard.io", name, "--ignore-not-found",
              "--wait=false")]
    if tainted:
        steps.insert(0, ("kubectl", "taint", "node", tainted, f"{key}:{effect}-"))
    for cmd in steps:
        try:
            c.run(*cmd, write=True)
        except CheckFailed as e:
            print(f"cleanup: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
