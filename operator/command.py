"""``liveshard operator``: run the ElasticTrainingJob operator (kopf) against a cluster."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from liveshard.operator.options import DEFAULT_LEASE_NAME, LeaderElection, Options
from liveshard.operator.policy import (
    ALLOW_HOST_PATH_FLAG,
    DEFAULT_API_SERVER_CIDRS,
    DEFAULT_API_SERVER_PORTS,
    DNS_CHOICES,
    DNS_KUBE_DNS,
    Egress,
    JobPolicy,
)

# The namespace a pod runs in, as its service account token's mount tells it.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
EXIT_LEADERSHIP_LOST = 1  # the process exits and starts again (the Deployment restarts it) as a candidate
STOP_FLAG_POLL_SECONDS = 0.1


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; globs allowed); default: all namespaces")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account, then ~/.kube/config)")
    p.add_argument("--server", help="API server URL without credentials (local emulator)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port; 0 turns it off")
    p.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR",
                   help="address the metrics port listens on (default 0.0.0.0: every interface; 127.0.0.1: this host only)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="liveness probe endpoint URL; empty turns it off")
    p.add_argument("--watch-timeout", type=int, default=300,
                   help="seconds after which watches are restarted (the client gives up 30 s later)")
    le = p.add_argument_group("leader election (one replica acts; the others wait for its Lease)")
    le.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                    help="hold a coordination.k8s.io Lease while acting (default: on); turn it off only "
                         "with a single replica")
    le.add_argument("--leader-election-namespace",
                    help="namespace of the Lease (default: $POD_NAMESPACE, then the pod's own namespace, "
                         "then default)")
    le.add_argument("--leader-election-lease", default=DEFAULT_LEASE_NAME,
                    help=f"name of the Lease (default {DEFAULT_LEASE_NAME})")
    le.add_argument("--lease-duration", type=float, default=15.0,
                    help="seconds a Lease not renewed stays its holder's (default 15)")
    le.add_argument("--renew-deadline", type=float, default=10.0,
                    help="a leader that has not renewed within this many seconds stops (default 10)")
    le.add_argument("--retry-period", type=float, default=2.0, help="seconds between tries (default 2)")
    wh = p.add_argument_group("validating admission webhook")
    wh.add_argument("--webhook-port", type=int, help="serve the validating admission webhook (HTTPS) on this port")
    wh.add_argument("--webhook-address", default="0.0.0.0", metavar="ADDR",
                    help="address the webhook listens on (default 0.0.0.0: every interface)")
    wh.add_argument("--webhook-cert-file", help="PEM certificate (chain) the webhook serves, e.g. tls.crt of a "
                                                "kubernetes.io/tls Secret")
    wh.add_argument("--webhook-key-file", help="its PEM private key, e.g. tls.key")
    jobs = p.add_argument_group("what jobs may do")
    jobs.add_argument(ALLOW_HOST_PATH_FLAG, action="store_true",
                      help="accept hostPath volumes in spec.checkpoint.volume (refused by default)")
    jobs.add_argument("--egress-policy", action=argparse.BooleanOptionalAction, default=True,
                      help="limit the egress of jobs' pods with their NetworkPolicies (default: on)")
    jobs.add_argument("--dns-egress", choices=DNS_CHOICES, default=DNS_KUBE_DNS,
                      help="DNS the jobs' pods may reach on port 53: pods labelled k8s-app=kube-dns in any "
                           "namespace (default), or any address (NodeLocal DNSCache, DNS outside the cluster)")
    jobs.add_argument("--api-server-cidr", action="append",
                      help="address range of the API server the coordinators may reach (repeatable; default "
                           f"{', '.join(DEFAULT_API_SERVER_CIDRS)})")
    jobs.add_argument("--api-server-port", action="append", type=int,
                      help="its port (repeatable; default " + ", ".join(map(str, DEFAULT_API_SERVER_PORTS)) + ")")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def options_from(args: argparse.Namespace) -> Options:
    from liveshard.runtime.errors import ConfigError

    if args.watch_timeout < 1:
        raise ConfigError("--watch-timeout", f"{args.watch_timeout} is not a positive number of seconds")
    for flag, port in (("--metrics-port", args.metrics_port), ("--webhook-port", args.webhook_port)):
        if port is not None and not 0 <= port < 65536:
            raise ConfigError(flag, f"{port} is not a port number", "use 1..65535, or 0 for none")
    return Options(namespaces=tuple(args.namespace), server=args.server, kubeconfig=args.kubeconfig,
                   metrics_port=args.metrics_port or None, metrics_addr=_address(args.metrics_address, "--metrics-address"),
                   liveness=args.liveness or None,
                   watch_server_timeout=args.watch_timeout, watch_client_timeout=args.watch_timeout + 30,
                   leader_election=_leader_election(args) if args.leader_election else None,
                   **_webhook(args), policy=_policy(args))


def _leader_election(args: argparse.Namespace) -> LeaderElection:
    from liveshard.runtime.errors import ConfigError

    if not 0 < args.retry_period < args.renew_deadline < args.lease_duration:
        raise ConfigError("--renew-deadline", f"needs 0 < --retry-period ({args.retry_period:g}) < --renew-deadline "
                          f"({args.renew_deadline:g}) < --lease-duration ({args.lease_duration:g})",
                          "a leader must give up before another replica may take the lease over")
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE") or _own_namespace() or "default"
    # unique per process: the pod's name for people, a random part for a restarted container
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return LeaderElection(namespace=namespace, name=args.leader_election_lease, identity=identity,
                          lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
                          retry_period=args.retry_period)


def _own_namespace() -> str | None:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


def _webhook(args: argparse.Namespace) -> dict[str, Any]:
    from liveshard.runtime.errors import ConfigError

    files = {"--webhook-cert-file": args.webhook_cert_file, "--webhook-key-file": args.webhook_key_file}
    if not args.webhook_port:
        given = [flag for flag, path in files.items() if path]
        if given:
            raise ConfigError(given[0], "is given without --webhook-port", "add --webhook-port 9443, or drop it")
        return {}
    for flag, path in files.items():
        if not path:
            raise ConfigError(flag, "is required with --webhook-port",
                              "give the PEM files of a certificate for the webhook Service's DNS name, "
                              "e.g. a cert-manager Secret mounted into the pod (tls.crt, tls.key)")
        if not Path(path).is_file():
            raise ConfigError(flag, f"{path} is not a file", "mount the certificate's Secret there")
    return {"webhook_port": args.webhook_port, "webhook_cert_file": args.webhook_cert_file,
            "webhook_key_file": args.webhook_key_file, "webhook_addr": _address(args.webhook_address, "--webhook-address")}


def _address(text: str, flag: str) -> str:
    """An IP address to listen on (IPv4 or IPv6, no host names: the process binds it as given)."""
    import ipaddress

    from liveshard.runtime.errors import ConfigError

    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        raise ConfigError(flag, f"{text!r} is not an IP address", "e.g. 0.0.0.0 (every interface) or 127.0.0.1") from None


def _policy(args: argparse.Namespace) -> JobPolicy:
    from liveshard.runtime.errors import ConfigError

    cidrs = tuple(args.api_server_cidr or DEFAULT_API_SERVER_CIDRS)
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ConfigError("--api-server-cidr", f"{cidr!r} is not an address range",
                              "write it as CIDR, e.g. 10.0.0.0/16 or 172.20.0.1/32") from None
    ports = tuple(args.api_server_port or DEFAULT_API_SERVER_PORTS)
    bad = next((port for port in ports if not 0 < port < 65536), None)
    if bad is not None:
        raise ConfigError("--api-server-port", f"{bad} is not a port number", "use 1..65535")
    return JobPolicy(allow_host_path_checkpoints=args.allow_host_path_checkpoints,
                     egress=Egress(enabled=args.egress_policy, dns=args.dns_egress, api_server_cidrs=cidrs,
                                   api_server_ports=ports))


def run(args: argparse.Namespace) -> int:
    import kopf

    kopf.configure(verbose=args.verbose)
    return run_operator(options_from(args))


def run_operator(options: Options, stop_flag: Any = None, ready_flag: Any = None) -> int:
    """Run until stopped (a signal, or ``stop_flag``, a ``threading.Event``, set from another
    thread). Returns 0, or ``EXIT_LEADERSHIP_LOST`` when this replica lost the leader lease (it
    stopped acting; the process should exit and start again as a candidate)."""
    from prometheus_client import start_http_server

    import liveshard.operator.handlers  # noqa: F401  (importing registers the handlers)
    from liveshard.operator.context import Context
    from liveshard.operator.kube import Kube
    from liveshard.runtime.control.kubeapi import make_api_client

    context = Context(kube=Kube(make_api_client(options.server, options.kubeconfig), options.api_workers),
                      options=options)
    if options.metrics_port:
        start_http_server(options.metrics_port, addr=options.metrics_addr)
    return asyncio.run(_operate(context, stop_flag, ready_flag))


async def _operate(context: Any, stop_flag: Any, ready_flag: Any) -> int:
    """The webhook (every replica), the lease (when elected), then kopf while the lease is held."""
    import kopf

    from liveshard.operator import admission
    from liveshard.operator.leader import LeaderElector, LeaseStore

    options: Options = context.options
    # kopf stops on this asyncio event (a threading.Event would leave an executor thread waiting
    # on it when the operator stops for another reason, and asyncio.run would wait for that thread)
    stop = asyncio.Event()
    background = []
    if stop_flag is not None:
        background.append(asyncio.create_task(_follow(stop_flag, stop)))
    if options.webhook_port:
        background.append(asyncio.create_task(admission.serve(options)))
    elector = None
    try:
        election = options.leader_election
        if election is not None:
            elector = LeaderElector(LeaseStore(context.kube.api, election.namespace, election.name,
                                               timeout=election.renew_deadline), election)
            context.kube.fence = lambda: elector.is_leader
            # kopf serves the liveness endpoint once it runs; until then a waiting replica is alive too
            health = await _standby_health(options.liveness) if options.liveness else None
            try:
                if not await elector.acquire(stop):
                    return 0
            finally:
                if health is not None:
                    await health.cleanup()
            background.append(asyncio.create_task(elector.keep(stop)))
        await kopf.operator(
            standalone=True,  # no kopf peering: the Lease decides which replica acts
            clusterwide=not options.namespaces,
            namespaces=options.namespaces,
            liveness_endpoint=options.liveness,
            memo=kopf.Memo(context=context),
            stop_flag=stop,
            ready_flag=ready_flag,
        )
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if elector is not None:
            if not elector.lost:
                await elector.release()
            elector.store.close()
    return EXIT_LEADERSHIP_LOST if elector is not None and elector.lost else 0


async def _follow(flag: Any, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``flag`` (set from another thread) is."""
    is_set = flag.is_set if hasattr(flag, "is_set") else flag.done
    while not is_set():
        await asyncio.sleep(STOP_FLAG_POLL_SECONDS)
    stop.set()


async def _standby_health(url: str) -> Any:
    """Answer the liveness probe while waiting for the lease: ``{"leader": false}``."""
    import urllib.parse

    import aiohttp.web

    parts = urllib.parse.urlsplit(url)

    async def health(_: Any) -> Any:
        return aiohttp.web.json_response({"leader": False})

    app = aiohttp.web.Application()
    app.router.add_get(parts.path or "/", health)
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, parts.hostname, parts.port or 80, reuse_address=True).start()
    return runner
