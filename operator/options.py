"""How the operator runs: the ``liveshard operator`` flags as one value. No heavy imports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Options:
    """How the operator runs (``liveshard operator`` flags)."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    server: str | None = None  # API server URL (tests, embedded cluster)
    kubeconfig: str | None = None
    metrics_port: int | None = 9090
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    watch_server_timeout: int = 300  # ask the API server to end watches after this long
    watch_client_timeout: int = 330  # and give up on a silent stream a little later
    api_workers: int = 16
    webhook_port: int | None = None  # serve the validating admission webhook on this port
    webhook_host: str | None = None  # the name the API server reaches it by (e.g. the Service DNS)
