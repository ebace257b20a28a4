"""``liveshard demo``: a job trains on the local cluster through a spot notice, a node joining
and a node lost without notice, and the run is checked.

``Demo`` holds one run's state; each method is one step of the story, and the e2e tests call
the same methods. Everything goes through the API (the official kubernetes client) as a cloud,
a person or NTH would; progress is read from the job's status and the coordinator's store.

The story (3 GPU nodes of 1 "GPU" each, a job of 3 worker pods):

1. two nodes: the job starts on 2 workers (worker-2 stays Pending);
2. **join**: node ``gpu-2`` is added; worker-2 runs, the operator plans 3 workers;
3. **spot notice**: the node of one member gets AWS NTH's spot-ITN taint; the operator plans
   without it, the runtime switches, acks, and only then the leaving pod is deleted;
4. **node lost**: another member's node dies (processes SIGKILLed, node NotReady); the
   coordinator recovers on the survivors at once, and the operator's plan follows.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from liveshard.dev.localcluster.cluster import LocalCluster
from liveshard.dev.localcluster.node_agent import SPOT_ITN_TAINT
from liveshard.dev.localcluster.sample import sample_job
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.keys import Keys


@dataclass
class ClusterEvent:
    kind: str  # join | spot-notice | node-lost
    node: str
    time: float
    pods: list[str] = field(default_factory=list)
    plan_generation: int | None = None  # the operator plan that answered it
    acked_after: float | None = None  # seconds from the event to the ack
    detail: dict[str, Any] = field(default_factory=dict)


class DemoFailed(Exception):
    pass


class Demo:
    def __init__(self, out: str | Path, job: str = "tiny-gpt", namespace: str = "default",
                 log: TextIO | None = sys.stdout, gpu_nodes: int = 3, replicas: int = 3,
                 gpus_per_worker: int = 1, global_batch: int = 240, train_iters: int = 100_000) -> None:
        self.out = Path(out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results").mkdir(exist_ok=True)
        self.job, self.ns, self.log = job, namespace, log
        self.gpu_nodes, self.replicas, self.gpus_per_worker = gpu_nodes, replicas, gpus_per_worker
        # gpu_nodes - 1 nodes at the start (the story's third node joins later); each node has
        # room for one worker pod, which runs one process per GPU
        self.cluster = LocalCluster(self.out, nodes=gpu_nodes - 1, gpus_per_node=gpus_per_worker)
        self.global_batch = global_batch
        self.train_iters = train_iters  # the demo stops the job long before; a test may let it finish
        self.events: list[ClusterEvent] = []
        self.samples: list[dict] = []  # (time, step, loss, world) as seen live
        self.started = time.time()
        self.store: Any = None
        self._seen_history = 0
        self.final_status: dict | None = None
        self.deleted_after_stop: list[str] = []  # worker pods that did not exit on the stop key
        self.final_coordinator: dict = {}
        self._last_line = ""

    # ---- set-up ------------------------------------------------------------------------------
    def start(self) -> None:
        import kubernetes.client as k8s

        self.cluster.start()
        self.core = k8s.CoreV1Api(self.cluster.api)
        self.custom = k8s.CustomObjectsApi(self.cluster.api)
        self.say(f"cluster up: kubeconfig {self.cluster.kubeconfig} ({self.cluster.kube.url})")
        from liveshard.runtime.data.corpus import BUILTIN_VOCAB, build_corpus, builtin_corpus_dir

        corpus = build_corpus(builtin_corpus_dir(), vocab_size=BUILTIN_VOCAB)
        self.say(f"corpus: {corpus.data_prefix} (tokenizer {corpus.tokenizer_dir})")
        body = sample_job(self.job, self.ns, replicas=self.replicas, global_batch=self.global_batch,
                          gpus_per_worker=self.gpus_per_worker, corpus=corpus, train_iters=self.train_iters,
                          checkpoint_dir=str(self.out / "checkpoints"),
                          extra_args=("--result", str(self.out / "results" / "$(LIVESHARD_POD_NAME).json")))
        (self.out / "job.json").write_text(json.dumps(body, indent=2))
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
        self.say(f"applied ElasticTrainingJob {self.ns}/{self.job}: tiny-gpt, {self.replicas} worker pods "
                 f"x {self.gpus_per_worker} GPU(s), "
                 f"global batch {self.global_batch}")

    def stop(self) -> None:
        self.cluster.stop()

    # ---- reading the state -------------------------------------------------------------------
    def status(self) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.job).get("status") or {}

    def pods(self) -> dict[str, dict]:
        api = self.cluster.api
        items = api.sanitize_for_serialization(self.core.list_namespaced_pod(self.ns)).get("items", [])
        return {p["metadata"]["name"]: p for p in items}

    def secret(self) -> bytes:
        """The job's store secret (the Secret the operator made), as its pods get it."""
        from liveshard.operator.builders import SECRET_KEY, secret_name

        return self.cluster.agent.secret_value(self.ns, secret_name(self.job), SECRET_KEY).encode()

    def coordinator(self) -> dict:
        if self.store is None:
            from liveshard.runtime.control.store import JobStore, connect_store

            port = self.cluster.agent.coordinator_port(self.ns, self.job)
            try:
                # a plain TCP probe first: before the coordinator listens, c10d logs every failed
                # connect with a C++ stack trace on this console
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            except OSError:
                return {}
            try:
                # values are bound to the job's incarnation (its uid), as its pods' are
                uid = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.job)["metadata"]["uid"]
                self.store = JobStore(connect_store("127.0.0.1", port, timeout=5.0), self.job, self.secret(),
                                      incarnation=uid)
            except Exception:
                return {}
        try:
            text = self.store.get(Keys.COORDINATOR_STATUS)
        except Exception:
            return {}
        return json.loads(text) if text else {}

    def say(self, text: str) -> None:
        if self.log is not None:
            print(f"[{time.time() - self.started:6.1f}s] {text}", file=self.log, flush=True)

    def poll(self) -> tuple[dict, dict]:
        """Read the job and the coordinator once; print what changed (the live view)."""
        if not self.cluster.operator_alive():
            raise DemoFailed(f"the operator exited (see {self.out}/logs/operator.log)")
        st, co = self.status(), self.coordinator()
        tele = co.get("telemetry") or {}
        members = co.get("members") or []
        beats = [tele[m] for m in members if m in tele and tele[m].get("step") is not None]
        if beats:
            step = max(b["step"] for b in beats)
            loss = next((b["loss"] for b in beats if b.get("loss") is not None), None)
            self.samples.append({"time": time.time(), "step": step, "loss": loss, "world": len(members)})
        plan = st.get("plan") or {}
        line = (f"phase {st.get('phase', '-'):<13} plan {plan.get('generation', '-')} "
                f"[{plan.get('config', '-')}] acked {st.get('appliedGeneration', '-')} | "
                f"world {len(members)} | step {self.samples[-1]['step'] if self.samples else '-'} "
                f"loss {self.samples[-1]['loss'] if self.samples and self.samples[-1]['loss'] is not None else '-'}")
        if line != self._last_line:
            self._last_line = line
            self.say(line)
        history = co.get("history") or []
        for h in history[self._seen_history:]:
            phases = ", ".join(f"{k} {v:.2f}s" for k, v in sorted((h.get("phases") or {}).items()))
            self.say(f"  reconfiguration (runtime generation {h.get('generation')}): {h.get('outcome')} -> "
                     f"{h.get('config')} on {h.get('world_size')} | {h.get('reason')} | "
                     f"downtime {h.get('downtime', 0):.2f}s | {phases}")
        self._seen_history = len(history)
        return st, co

    def wait(self, what: str, cond, timeout: float = 180.0) -> tuple[dict, dict]:
        end = time.monotonic() + timeout
        while True:
            st, co = self.poll()
            if cond(st, co):
                return st, co
            if time.monotonic() > end:
                raise DemoFailed(f"timed out after {timeout:.0f} s waiting for {what}; job status: "
                                 f"{json.dumps({k: st.get(k) for k in ('phase', 'message', 'plan')})[:600]}")
            time.sleep(0.5)

    @staticmethod
    def acked(st: dict) -> bool:
        plan = st.get("plan") or {}
        return bool(plan) and int(st.get("appliedGeneration") or 0) >= int(plan.get("generation") or 0)

    def step(self) -> int:
        return self.samples[-1]["step"] if self.samples else 0

    def more_steps(self, n: int, what: str = "") -> None:
        """Wait until the job has trained ``n`` steps past the one it is at now."""
        start = self.step()
        self.wait(f"{n} more steps{what}", lambda s, c: self.step() >= start + n)

    def node_of(self, pod: str) -> str:
        return self.pods()[pod]["spec"]["nodeName"]

    # ---- the story ---------------------------------------------------------------------------
    def wait_training(self, members: int, steps: int = 3) -> dict:
        """The plan with ``members`` worker pods is acked and training went ``steps`` further
        (the runtime's world has ``members * gpus_per_worker`` ranks)."""
        st, _ = self.wait(f"a plan of {members} workers acked", lambda s, c: self.acked(s)
                          and len((s.get("plan") or {}).get("members") or []) == members
                          and len(c.get("members") or []) == members * self.gpus_per_worker)
        start = self.step()
        self.wait(f"{steps} more steps", lambda s, c: self.step() >= start + steps)
        return st

    def join(self, node: str) -> ClusterEvent:
        ev = ClusterEvent("join", node, time.time())
        self.events.append(ev)
        self.say(f"EVENT node {node} joins")
        self.cluster.add_gpu_node(node)
        return ev

    def spot_notice(self, pod: str) -> ClusterEvent:
        node = self.node_of(pod)
        ev = ClusterEvent("spot-notice", node, time.time(), [pod], detail={"uid": self.pods()[pod]["metadata"]["uid"]})
        self.events.append(ev)
        self.say(f"EVENT spot interruption notice on {node} (pod {pod}): taint {SPOT_ITN_TAINT}")
        self.cluster.agent.taint(node, SPOT_ITN_TAINT, "spot-itn-local", "NoSchedule")
        return ev

    def lose_node(self, pod: str) -> ClusterEvent:
        node = self.node_of(pod)
        ev = ClusterEvent("node-lost", node, time.time())
        self.events.append(ev)
        ev.pods = self.cluster.agent.lose_node(node)
        self.say(f"EVENT node {node} lost without notice: killed {', '.join(ev.pods)}")
        return ev

    def answer(self, ev: ClusterEvent, members: list[str]) -> dict:
        """Wait until a plan with exactly ``members`` is acked; record it on the event."""
        st, _ = self.wait(f"an acked plan of {members} after {ev.kind}", lambda s, c: self.acked(s)
                          and sorted((s.get("plan") or {}).get("members") or []) == sorted(members))
        ev.plan_generation = int(st["plan"]["generation"])
        ev.acked_after = time.time() - ev.time
        ev.detail.update(config=st["plan"].get("config"), reason=st["plan"].get("reason"))
        self.say(f"  {ev.kind}: operator plan {ev.plan_generation} acked {ev.acked_after:.1f} s after the event")
        return st

    def finish(self, timeout: float = 120.0) -> None:
        """End the story: stop the operator, ask every worker to stop (the store's stop key) and
        wait for their results. The operator goes first: the stop key is the runtime's own, not a
        request the job's spec can express, so a running operator would take the exited pods for
        lost ones and start the job again (a new coordinator's store has no stop key)."""
        from liveshard.runtime.contract.keys import Keys

        self.final_coordinator = self.coordinator()
        self.final_status = self.status()  # the stop ends the job's pods: judge the plans before it
        self.cluster.stop_operator()
        self.store.set(Keys.STOP, "1")
        # the members read the stop within seconds; a pod still running after 30 s is one that
        # was starting when the stop came (below)
        running = self._wait_workers_gone(min(30.0, timeout / 2))
        if running:
            # A pod still starting when the stop came (a replacement) registers after the
            # coordinator drained and exited: its restarted coordinator's store has no stop key.
            # It is ended as kubectl delete ends a pod (SIGTERM, then the grace period).
            self.say(f"  {', '.join(running)} still running after the stop: deleting the pod(s)")
            self.deleted_after_stop = running
            for name in running:
                self.core.delete_namespaced_pod(name, self.ns)
            running = self._wait_workers_gone(timeout / 2)
        if running:
            raise DemoFailed(f"workers still running {timeout:.0f} s after the stop: {running}")

    def _wait_workers_gone(self, timeout: float) -> list[str]:
        """Wait until no worker pod runs (those of lost nodes aside); the ones still running."""
        end = time.monotonic() + timeout
        while True:
            running = [n for n, p in self.pods().items() if "worker" in n
                       and p["status"].get("phase") == "Running" and p["spec"].get("nodeName") not in self.cluster.agent.lost]
            if not running or time.monotonic() > end:
                return running
            time.sleep(0.5)

    # ---- checks and report -------------------------------------------------------------------
    def results(self) -> dict[str, dict]:
        """Result file stem -> the worker's result: ``<pod>``, or ``<pod>.<local rank>`` when a
        pod runs several processes (``liveshard worker --result``)."""
        out = {}
        for f in sorted((self.out / "results").glob("*.json")):
            out[f.stem] = json.loads(f.read_text())
        return out

    def pod_of_result(self, stem: str) -> str:
        return stem.rpartition(".")[0] if self.gpus_per_worker > 1 else stem

    def check(self) -> tuple[list[dict], list[str]]:
        """The merged step records and the list of problems (empty: training was correct)."""
        problems: list[str] = []
        results = self.results()
        steps: dict[int, dict] = {}
        for pod, res in results.items():
            prev = 0
            for rec in res["steps"]:
                if rec["step"] <= prev:
                    problems.append(f"{pod}: step {rec['step']} after step {prev}")
                prev = rec["step"]
                if rec["consumed_samples"] != rec["step"] * self.global_batch:
                    problems.append(f"{pod}: step {rec['step']} consumed {rec['consumed_samples']} samples, "
                                    f"expected {rec['step'] * self.global_batch}")
                s = steps.setdefault(rec["step"], {**rec, "time": rec["time"]})
                if rec.get("loss") is not None:
                    s["loss"] = rec["loss"]
                s["time"] = max(s["time"], rec["time"])
                if s["generation"] != rec["generation"]:
                    problems.append(f"step {rec['step']} ran in runtime generations {s['generation']} and "
                                    f"{rec['generation']}")
        ordered = [steps[k] for k in sorted(steps)]
        if not ordered:
            problems.append("no step records")
        elif [s["step"] for s in ordered] != list(range(1, len(ordered) + 1)):
            problems.append("steps are not 1..N without gaps")
        st = self.final_status or self.status()
        plan = st.get("plan") or {}
        if int(st.get("appliedGeneration") or 0) != int(plan.get("generation") or -1):
            problems.append(f"the last plan {plan.get('generation')} is not acked ({st.get('appliedGeneration')})")
        if st.get("abortedGeneration"):
            problems.append(f"plan {st['abortedGeneration']} was aborted: {st.get('abortReason')}")
        for ev in self.events:
            if ev.plan_generation is None:
                problems.append(f"{ev.kind} on {ev.node} got no acked plan")
        lost = {p for ev in self.events if ev.kind == "node-lost" for p in ev.pods}
        # a worker started again is a crash, except the spot victim's replacement: its pod is
        # deleted after the leave and recreated, and it starts wherever it fits
        replaced = {p for ev in self.events if ev.kind == "spot-notice" for p in ev.pods}
        for pod, n in sorted(self.cluster.agent.starts.items()):
            if "worker" in pod and n > 1 + (pod in replaced):
                problems.append(f"{pod} was started {n} times")
        for name, res in results.items():
            if self.pod_of_result(name) not in lost and res.get("phase") not in ("exited", "left"):
                problems.append(f"{name} ended in phase {res.get('phase')}")
            elif self.pod_of_result(name) in lost:
                problems.append(f"{name} was lost but wrote a result")
        if self.gpus_per_worker > 1:
            ranks: dict[str, int] = {}
            for name in results:
                ranks[self.pod_of_result(name)] = ranks.get(self.pod_of_result(name), 0) + 1
            problems += [f"{pod} wrote {n} results for {self.gpus_per_worker} GPUs"
                         for pod, n in sorted(ranks.items()) if n != self.gpus_per_worker]
        return ordered, problems

    def report(self, ordered: list[dict], problems: list[str], error: str | None = None) -> dict:
        co = self.final_coordinator or (self.coordinator() if self.store is not None else {})
        times = [s["time"] for s in ordered]
        for i, ev in enumerate(self.events):
            # the wall-clock pause training saw: the longest gap between step completions from
            # the event to a few seconds after its plan was acked (or the next event)
            end = ev.time + (ev.acked_after or 0.0) + 5.0
            if i + 1 < len(self.events):
                end = min(end, self.events[i + 1].time)
            gaps = [b - a for a, b in itertools.pairwise(times) if b >= ev.time and a <= end]
            ev.detail["longest_step_gap_seconds"] = round(max(gaps), 3) if gaps else None
        report = {
            "ok": not problems and error is None,
            "error": error,
            "problems": problems,
            "job": f"{self.ns}/{self.job}",
            "global_batch": self.global_batch,
            "started": self.started,
            "steps": ordered,
            "events": [ev.__dict__ for ev in self.events],
            # the coordinator's record: runtime generations with phases and downtime
            "reconfigurations": (co.get("history") if co else None) or [],
            "job_status": self._status_or_none(),
            # how the story ended: the job's status above is the operator's last word before it
            "end": (f"stopped by the demo after step {ordered[-1]['step']}: the operator first, then every "
                    "worker (the store's stop key); trainIters was not reached" if self.final_status is not None
                    and ordered else None),
            "deleted_after_stop": self.deleted_after_stop,
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        if ordered:
            plot(ordered, self.events, self.out / "report.png", self.started)
        return report


    def _status_or_none(self) -> dict | None:
        try:
            return self.status()
        except Exception:
            return None


def plot(steps: list[dict], events: list[ClusterEvent], path: Path, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput, ax_world) = plt.subplots(3, 1, figsize=(10, 8), sharex=True,
                                                      gridspec_kw={"height_ratios": [3, 3, 1.4]})
    t = [s["time"] - t0 for s in steps]
    ax_loss.plot(t, [s["loss"] for s in steps], ".-", lw=1, ms=3, color="tab:blue")
    ax_loss.set_ylabel("loss")
    tput_t, tput = [], []
    for a, b in itertools.pairwise(steps):
        dt = b["time"] - a["time"]
        if dt > 0:
            tput_t.append(b["time"] - t0)
            tput.append((b["consumed_samples"] - a["consumed_samples"]) / dt)
    ax_tput.plot(tput_t, tput, ".-", lw=1, ms=3, color="tab:green")
    ax_tput.set_ylabel("samples / s")
    # the world each step trained in (the runtime's own record of it)
    ax_world.step(t, [s.get("world_size") or 0 for s in steps], where="post", color="tab:purple", lw=1.5)
    ax_world.set_ylabel("world size")
    ax_world.set_yticks(sorted({s.get("world_size") or 0 for s in steps}))
    ax_world.set_xlabel("seconds since start")
    colors = {"join": "tab:green", "spot-notice": "tab:orange", "node-lost": "tab:red"}
    for ev in events:
        color = colors.get(ev.kind, "gray")
        for ax in (ax_loss, ax_tput, ax_world):
            ax.axvline(ev.time - t0, color=color, ls="--", lw=1)  # the event
            if ev.acked_after is not None:  # its plan in effect: the runtime acked it
                ax.axvline(ev.time + ev.acked_after - t0, color=color, ls="-", lw=1, alpha=0.6)
        took = f"\nin effect +{ev.acked_after:.1f} s" if ev.acked_after is not None else "\nno plan in effect"
        ax_loss.annotate(f"{ev.kind}\n{ev.node}{took}", (ev.time - t0, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, -3), textcoords="offset points", fontsize=8, va="top", ha="left", color=color)
    fig.suptitle("liveshard demo: tiny GPT on the local cluster (world changes live; dashed: the event, "
                 "solid: its plan in effect)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(out: str | Path, log: TextIO | None = sys.stdout) -> int:
    demo = Demo(out, log=log)
    ordered: list[dict] = []
    problems: list[str] = []
    error = None
    try:
        demo.start()
        demo.wait_training(2)
        demo.join("gpu-2")
        demo.answer(demo.events[-1], [f"{demo.job}-worker-{i}" for i in range(3)])
        demo.more_steps(3)
        victim = f"{demo.job}-worker-1"
        ev = demo.spot_notice(victim)
        demo.answer(ev, [f"{demo.job}-worker-0", f"{demo.job}-worker-2"])
        demo.wait(f"{victim} deleted after the ack", lambda s, c: victim not in demo.pods()
                  or demo.pods()[victim]["spec"].get("nodeName") != ev.node)
        demo.more_steps(3)
        ev = demo.lose_node(f"{demo.job}-worker-2")
        demo.answer(ev, [f"{demo.job}-worker-0"])
        demo.more_steps(3)
        demo.finish()
        ordered, problems = demo.check()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        demo.say(f"FAILED: {error}")
    finally:
        try:
            report = demo.report(ordered, problems, error)
        finally:
            demo.stop()
    for p in problems:
        demo.say(f"PROBLEM: {p}")
    demo.say(f"report: {demo.out / 'report.json'}, plot: {demo.out / 'report.png'}; "
             f"{len(ordered)} steps, {len(demo.events)} events: {'OK' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1
