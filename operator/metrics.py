"""Prometheus metrics of the operator (prometheus_client, default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REPLANS = Counter("liveshard_replans", "Plans the operator wrote, by reason", ["reason"])
NOTICE_TO_PLAN = Histogram(
    "liveshard_notice_to_plan_seconds",
    "From the operator seeing a node or pod signal to the plan that moves work off it being written",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONFIGURATION = Histogram(
    "liveshard_reconfiguration_seconds",
    "From a plan being written to the runtime acking it",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
WORLD_SIZE = Gauge("liveshard_world_size", "GPUs in the plan the runtime runs", ["namespace", "job"])
WORKER_FAILURES = Counter("liveshard_worker_failures", "Worker losses that were not planned removals",
                          ["namespace", "job"])
RECONCILE_ERRORS = Counter("liveshard_reconcile_errors", "Reconcile passes that raised", ["kind"])
