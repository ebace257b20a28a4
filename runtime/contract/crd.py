"""The ElasticTrainingJob resource and the labels on everything it owns: named once, here."""

from __future__ import annotations

GROUP = "liveshard.io"
VERSION = "v1alpha1"
PLURAL = "elastictrainingjobs"
KIND = "ElasticTrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

LABEL_JOB = "liveshard.io/job"
LABEL_ROLE = "liveshard.io/role"
LABEL_INDEX = "liveshard.io/worker-index"
ROLE_WORKER = "worker"
ROLE_COORDINATOR = "coordinator"

# The store (c10d TCPStore) port the coordinator serves unless spec.coordinator.port says otherwise.
DEFAULT_COORDINATOR_PORT = 29400

DEFAULT_METRICS_PORT = 9400  # the coordinator's Prometheus endpoint (the chart's PodMonitor scrapes it)
