"""``liveshard demo --kueue``: the demo's tiny GPT behind Kueue (the stand-in for its scheduler,
``kueue_standin.py``), on a local cluster of three one-GPU spot nodes with a ClusterQueue of 3
GPUs shared by two teams' LocalQueues.

The story: team A's elastic job (``kueue.x-k8s.io/elastic-job``, priority ``low``) is queued,
admitted and trains on 3 workers; team B's job (priority ``high``, one worker) arrives, the
stand-in preempts part of A's Workload, and A shrinks live to 2 workers (no restart) while B
runs on the freed node; B's job ends, A's replacement slice is admitted and A grows back to 3.
The report (``report.json``, ``report.png``) shows admission, preemption and regrowth against
A's training steps, loss and throughput.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

from liveshard.dev.localcluster.cluster import LocalCluster
from liveshard.dev.localcluster.demo import ClusterEvent, Demo
from liveshard.dev.localcluster.sample import sample_job
from liveshard.operator import kueue
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION

TEAM_B = "team-b"
URGENT = "urgent"


class KueueDemo(Demo):
    def __init__(self, out: str | Path, log: TextIO | None = sys.stdout) -> None:
        super().__init__(out, log=log, gpu_nodes=3, replicas=3)
        self.cluster = LocalCluster(self.out, nodes=3, gpus_per_node=1, kueue=True)
        self.corpus = None

    def start(self) -> None:
        import kubernetes.client as k8s

        from liveshard.runtime.data.corpus import BUILTIN_VOCAB, build_corpus, builtin_corpus_dir

        self.cluster.start()
        self.core = k8s.CoreV1Api(self.cluster.api)
        self.custom = k8s.CustomObjectsApi(self.cluster.api)
        self.custom.create_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, self.ns, "localqueues",
            {"apiVersion": f"{kueue.GROUP}/{kueue.VERSION}", "kind": "LocalQueue",
             "metadata": {"name": TEAM_B, "namespace": self.ns}, "spec": {"clusterQueue": "local"}})
        self.say(f"cluster up with Kueue's stand-in: ClusterQueue local (3 spot GPUs), LocalQueues default "
                 f"(team A) and {TEAM_B}; kubeconfig {self.cluster.kubeconfig}")
        self.corpus = build_corpus(builtin_corpus_dir(), vocab_size=BUILTIN_VOCAB)
        body = sample_job(self.job, self.ns, replicas=self.replicas, global_batch=self.global_batch,
                          corpus=self.corpus, train_iters=self.train_iters, checkpoint_dir=str(self.out / "checkpoints"),
                          extra_args=("--result", str(self.out / "results" / "$(LIVESHARD_POD_NAME).json")))
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "default", kueue.PRIORITY_CLASS_LABEL: "low"}
        body["metadata"]["annotations"] = {kueue.ELASTIC_JOB: "true"}
        (self.out / "job.json").write_text(json.dumps(body, indent=2))
        ev = ClusterEvent("queued", "-", time.time())
        self.events.append(ev)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
        self.say(f"applied elastic ElasticTrainingJob {self.ns}/{self.job} in queue default: {self.replicas} workers")

    def urgent(self) -> ClusterEvent:
        body = sample_job(URGENT, self.ns, replicas=1, global_batch=self.global_batch, corpus=self.corpus,
                          checkpoint_dir=str(self.out / "checkpoints-urgent"))
        body["metadata"]["labels"] = {kueue.QUEUE_LABEL: TEAM_B, kueue.PRIORITY_CLASS_LABEL: "high"}
        ev = ClusterEvent("preempted", "-", time.time(), [f"{self.job}-worker-2"])
        self.events.append(ev)
        self.say(f"EVENT team B's job {URGENT} (priority high, 1 worker) is queued in {TEAM_B}")
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
        return ev

    def urgent_ends(self) -> ClusterEvent:
        ev = ClusterEvent("regrown", "-", time.time(), [f"{self.job}-worker-2"])
        self.events.append(ev)
        self.say(f"EVENT team B's job {URGENT} ends (deleted): its quota is free")
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, URGENT)
        return ev

    def answer(self, ev: ClusterEvent, members: list[str], timeout: float = 420.0) -> dict:
        """Wait until a plan with exactly ``members`` is acked (pods queued, admitted, started:
        slower than a node event); record it on the event."""
        st, _ = self.wait(f"an acked plan of {members} after {ev.kind}", lambda s, c: self.acked(s)
                          and sorted((s.get("plan") or {}).get("members") or []) == sorted(members), timeout)
        ev.plan_generation = int(st["plan"]["generation"])
        ev.acked_after = time.time() - ev.time
        ev.detail.update(config=st["plan"].get("config"), reason=st["plan"].get("reason"))
        self.say(f"  {ev.kind}: operator plan {ev.plan_generation} acked {ev.acked_after:.1f} s after the event")
        return st

    def check(self) -> tuple[list[dict], list[str]]:
        ordered, problems = super().check()
        # the preempted worker's pod is deleted on the shrink and made again on the regrowth
        again = f"{self.job}-worker-2 was started 2 times"
        problems = [p for p in problems if p != again]
        log = self.cluster.standin.log if self.cluster.standin is not None else []
        for needed in ("admitted default/etj-" + self.job, "shrank default/etj-" + self.job, "replaced default/"):
            if not any(line.startswith(needed) for line in log):
                problems.append(f"the stand-in's log has no '{needed}...'")
        return ordered, problems


def run_kueue_demo(out: str | Path, log: TextIO | None = sys.stdout) -> int:
    demo = KueueDemo(out, log=log)
    ordered: list[dict] = []
    problems: list[str] = []
    error = None
    workers = [f"{demo.job}-worker-{i}" for i in range(3)]
    try:
        demo.start()
        demo.answer(demo.events[-1], workers)  # admitted, then trained on 3
        demo.wait_training(3)
        demo.answer(demo.urgent(), workers[:2])  # partially preempted: a live shrink
        demo.more_steps(3, " on 2 workers")
        demo.answer(demo.urgent_ends(), workers)  # the replacement slice admitted: grown back
        demo.more_steps(3, " on 3 workers")
        demo.finish()
        ordered, problems = demo.check()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        demo.say(f"FAILED: {error}")
    finally:
        try:
            report = demo.report(ordered, problems, error)
            if demo.cluster.standin is not None:
                report["kueue"] = demo.cluster.standin.log
                (demo.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        finally:
            demo.stop()
    for p in problems:
        demo.say(f"PROBLEM: {p}")
    demo.say(f"report: {demo.out / 'report.json'}, plot: {demo.out / 'report.png'}; "
             f"{len(ordered)} steps, {len(demo.events)} events: {'OK' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1
