"""``liveshard operator``: run the ElasticTrainingJob operator (kopf) against a cluster."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from liveshard.operator.options import Options


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; globs allowed); default: all namespaces")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account, then ~/.kube/config)")
    p.add_argument("--server", help="API server URL without credentials (local emulator)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port; 0 turns it off")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="liveness probe endpoint URL; empty turns it off")
    p.add_argument("--watch-timeout", type=int, default=300,
                   help="seconds after which watches are restarted (the client gives up 30 s later)")
    p.add_argument("--webhook-port", type=int, help="serve the validating admission webhook on this port")
    p.add_argument("--webhook-host", help="host name the API server reaches the webhook by")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def options_from(args: argparse.Namespace) -> Options:
    from liveshard.runtime.errors import ConfigError

    if args.watch_timeout < 1:
        raise ConfigError("--watch-timeout", f"{args.watch_timeout} is not a positive number of seconds")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ConfigError("--metrics-port", f"{args.metrics_port} is not a port number", "use 1..65535, or 0 for none")
    return Options(namespaces=tuple(args.namespace), server=args.server, kubeconfig=args.kubeconfig,
                   metrics_port=args.metrics_port or None, liveness=args.liveness or None,
                   watch_server_timeout=args.watch_timeout, watch_client_timeout=args.watch_timeout + 30,
                   webhook_port=args.webhook_port, webhook_host=args.webhook_host)


def run(args: argparse.Namespace) -> int:
    import kopf

    kopf.configure(verbose=args.verbose)
    run_operator(options_from(args))
    return 0


def run_operator(options: Options, stop_flag: Any = None, ready_flag: Any = None) -> None:
    """Run until stopped (signal, or ``stop_flag`` set from another thread)."""
    import kopf
    from prometheus_client import start_http_server

    import liveshard.operator.handlers  # noqa: F401  (importing registers the handlers)

    if options.webhook_port:
        from liveshard.operator.handlers import admission

        admission.register()
    from liveshard.operator.context import Context
    from liveshard.operator.kube import Kube
    from liveshard.runtime.control.kubeapi import make_api_client

    context = Context(kube=Kube(make_api_client(options.server, options.kubeconfig), options.api_workers),
                      options=options)
    if options.metrics_port:
        start_http_server(options.metrics_port)
    asyncio.run(kopf.operator(
        standalone=True,  # one operator per cluster: no peering objects needed
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        liveness_endpoint=options.liveness,
        memo=kopf.Memo(context=context),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    ))
