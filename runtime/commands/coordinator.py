"""``liveshard coordinator``: the job's store and reconfiguration driver."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from liveshard.runtime.contract.env import Defaults, Env
from liveshard.runtime.contract.jobspec import AdaptivePolicy
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner.world import FEWEST_CHANGES, OBJECTIVES


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=os.environ.get(Env.BIND, "0.0.0.0"), help="address the store listens on")
    p.add_argument("--port", type=int, default=int(os.environ.get(Env.PORT, "29400")),
                   help="port the store listens on (default $LIVESHARD_PORT, else 29400)")
    p.add_argument("--job-name", default=os.environ.get(Env.JOB, "job"),
                   help="the job's name (default $LIVESHARD_JOB)")
    p.add_argument("--model", default=None,
                   help="preset or YAML file (default: $LIVESHARD_MODEL, the ModelSpec JSON the operator sets)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step, for the store source (default 8; the kubernetes source reads the job)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per micro-batch (default: the job's microBatch, else 1)")
    p.add_argument("--heartbeat-timeout", type=float, default=Defaults.HEARTBEAT_TIMEOUT,
                   help=f"seconds of silence before a member is declared dead (default {Defaults.HEARTBEAT_TIMEOUT:g})")
    p.add_argument("--transition-timeout", type=float, default=Defaults.TRANSITION_TIMEOUT,
                   help="seconds a change may wait for a member that does not answer (or a request for a "
                        "worker that never registers) before it is aborted; members still training towards "
                        f"the switch extend it up to 4 times (default {Defaults.TRANSITION_TIMEOUT:g})")
    p.add_argument("--objective", choices=OBJECTIVES, default=FEWEST_CHANGES,
                   help="what the planner optimises when the coordinator plans alone with the store source "
                        "(the kubernetes source plans as the operator does, from the job's spec)")
    # In a pod the operator built (LIVESHARD_ROLE=coordinator) plans come from the job's status.
    p.add_argument("--source", choices=("store", "kubernetes"),
                   default="kubernetes" if os.environ.get(Env.ROLE) == "coordinator" else "store",
                   help="where plans come from: the local driver (store) or the job's status")
    p.add_argument("--namespace", default=os.environ.get(Env.NAMESPACE)
                   or os.environ.get("POD_NAMESPACE", "default"),
                   help="the job's namespace (default $LIVESHARD_NAMESPACE, else $POD_NAMESPACE, else default)")
    p.add_argument("--metrics-port", type=int,
                   default=int(os.environ.get(Env.METRICS_PORT) or (9400 if os.environ.get(Env.ROLE)
                                                                            == "coordinator" else 0)),
                   help="serve Prometheus metrics of the job on this port (0: off; default 9400 in a job's pod)")
    p.add_argument("--metrics-address", default=None, metavar="ADDR",
                   help="address the metrics port listens on (default: the store's, --host)")
    p.add_argument("--checkpoint-dir", default=os.environ.get(Env.CHECKPOINT_DIR) or None,
                   help="the job's checkpoints: a first world continues from the newest complete one of its "
                        "own; a directory holding another job's run is refused (exit 2) unless "
                        "spec.training.resume names where the job starts")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    g = p.add_argument_group("straggler policy (with --source kubernetes: the job's spec.elasticity.adaptive)")
    g.add_argument("--adaptive", action="store_true", help="re-plan around slow devices")
    policy = AdaptivePolicy()  # the job spec's defaults (spec.elasticity.adaptive)
    g.add_argument("--adaptive-threshold", type=float, default=policy.threshold,
                   help=f"relative speed below which a device is slow (default {policy.threshold})")
    g.add_argument("--adaptive-window", type=int, default=policy.window,
                   help=f"steps per speed estimate (default {policy.window})")
    g.add_argument("--adaptive-horizon", type=int, default=policy.horizon,
                   help=f"steps over which a switch must pay for itself (default {policy.horizon})")
    g.add_argument("--adaptive-min-gain", type=float, default=policy.min_gain,
                   help=f"least predicted saving, as a share of the step, worth a switch (default {policy.min_gain})")
    g.add_argument("--adaptive-probation", type=int, default=policy.probation,
                   help=f"steps a device set aside for slowness waits before it is tried again (default {policy.probation})")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from liveshard.runtime.contract.training import TRAINING_ENV, TrainingSpec
    from liveshard.runtime.control.store import JobStore, job_secret, serve_store
    from liveshard.runtime.coordinator import Coordinator, PlanningInputs, StorePlanSource
    from liveshard.runtime.planner import Constraints
    from liveshard.runtime.spec import model_from_ref_or_env

    if args.transition_timeout <= 0:
        raise ConfigError("--transition-timeout", f"must be > 0, got {args.transition_timeout:g}", "give seconds")
    spec = model_from_ref_or_env(args.model)
    # The job's training spec (the operator and the local driver set it): progress and ETA, and
    # the batch the store source plans with.
    training = TrainingSpec.from_json(os.environ[TRAINING_ENV]) if os.environ.get(TRAINING_ENV) else None
    if args.source == "kubernetes":
        from liveshard.runtime.coordinator.kube_source import KubePlanSource, api_client

        source = KubePlanSource(None, args.job_name, args.namespace, api=api_client(args.kubeconfig))
    _refuse_foreign_checkpoints(args, training, source if args.source == "kubernetes" else None)
    # The kubernetes source plans from the job's spec (refreshed at every poll); these are the
    # inputs until it has read a valid one, and the store source's for good.
    from liveshard.runtime.contract.jobspec import AdaptivePolicy

    adaptive = AdaptivePolicy(enabled=args.adaptive, threshold=args.adaptive_threshold, window=args.adaptive_window,
                              horizon=args.adaptive_horizon, min_gain=args.adaptive_min_gain,
                              probation=args.adaptive_probation)
    planning = PlanningInputs(Constraints(
        global_batch=args.global_batch or (training.global_batch if training else 8),
        micro_batch=args.micro_batch or (training.micro_batch if training else 1), objective=args.objective),
        adaptive=adaptive)
    if args.source == "kubernetes":
        planning = source.planning(refresh=True) or planning
    secret = job_secret()  # before serving: a pod without its job's secret does not start
    store = JobStore(serve_store(args.host, args.port), args.job_name, secret)
    if args.source == "kubernetes":
        from liveshard.runtime.coordinator import BackgroundSource

        source.store = store
        source = BackgroundSource(source)  # the API's I/O never on the thread that judges liveness
    else:
        source = StorePlanSource(store)
    metrics = None
    if args.metrics_port:
        from liveshard.runtime.control.metrics import JobMetrics

        metrics = serve_metrics(JobMetrics(args.job_name), args.metrics_port, args.metrics_address or args.host)
    coordinator = Coordinator(store, spec, source, planning, heartbeat_timeout=args.heartbeat_timeout,
                              transition_timeout=args.transition_timeout, training=training, metrics=metrics, checkpoint_dir=args.checkpoint_dir)
    coordinator.run()
    return 0


def _refuse_foreign_checkpoints(args: argparse.Namespace, training: Any, source: Any) -> None:
    """A checkpoint directory holding another job's run (an earlier job of the same name, another
    job on a shared volume) is refused before anything starts, unless ``spec.training.resume``
    names where this job starts from on purpose: one line, exit 2, and with the kubernetes source
    the job's ``status.runtimeFailure`` (the operator then fails the job with that line)."""
    from liveshard.runtime.contract.checkpoint import JobIdentity, foreign_run

    if getattr(training, "resume", None):
        return
    field = "spec.checkpoint.path" if args.source == "kubernetes" else "--checkpoint-dir"
    refused = foreign_run(args.checkpoint_dir, JobIdentity.from_env(), field)
    if refused is None:
        return
    if source is not None:
        from datetime import UTC, datetime

        from liveshard.runtime.contract.status import RuntimeFailure

        try:
            source.patch_status(RuntimeFailure("ForeignCheckpoints", str(refused), datetime.now(UTC)).to_status())
        except Exception as e:  # the exit (and the pod's log) still says it
            logging.getLogger("liveshard.coordinator").warning("could not report the refusal in the job's status: %s", e)
    raise refused


def serve_metrics(metrics: Any, port: int, address: str) -> Any:
    """``metrics`` served on ``address:port``; on a port another process holds (a second job on
    this machine) on a free one, said in one line; None (the job trains without its metrics
    rather than not at all) when it cannot be served."""
    import errno

    say = logging.getLogger("liveshard.coordinator").warning
    try:
        metrics.serve(port, address)
        return metrics
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            say("metrics: cannot serve on %s:%d (%s); the job's Prometheus metrics are off", address, port, e)
            return None
    try:
        server = metrics.serve(0, address)
    except OSError as e:
        say("metrics: cannot serve on %s (%s); the job's Prometheus metrics are off", address, e)
        return None
    say("metrics: port %d is in use; serving on %s:%d instead", port, address, server.server_port)
    return metrics
