"""How the operator runs: the ``liveshard operator`` flags as one value. No heavy imports."""

from __future__ import annotations

from dataclasses import dataclass, field

from liveshard.operator.policy import JobPolicy

DEFAULT_LEASE_NAME = "liveshard-operator"


@dataclass(frozen=True)
class LeaderElection:
    """A ``coordination.k8s.io/v1`` Lease that one replica holds while it acts (leader.py).

    Timings as client-go's leader election: a leader that cannot renew within ``renew_deadline``
    stops acting; another replica takes over once the lease has not been renewed for
    ``lease_duration`` by its own clock; every replica retries every ``retry_period``.
    """

    namespace: str
    name: str = DEFAULT_LEASE_NAME
    identity: str = ""  # unique per process: a restarted replica never mistakes an old lease for its own
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


@dataclass
class Options:
    """How the operator runs (``liveshard operator`` flags)."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    server: str | None = None  # API server URL (tests, embedded cluster)
    kubeconfig: str | None = None
    metrics_port: int | None = 9090
    metrics_addr: str = "0.0.0.0"
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    watch_server_timeout: int = 300  # ask the API server to end watches after this long
    watch_client_timeout: int = 330  # and give up on a silent stream a little later
    api_workers: int = 16
    # None: act at once, as the only replica (the command line turns election on by default)
    leader_election: LeaderElection | None = None
    webhook_port: int | None = None  # serve the validating admission webhook (HTTPS) on this port
    webhook_addr: str = "0.0.0.0"
    webhook_cert_file: str | None = None  # PEM certificate (chain) and key, e.g. a mounted kubernetes.io/tls Secret
    webhook_key_file: str | None = None
    policy: JobPolicy = field(default_factory=JobPolicy)
