"""``liveshard coordinator``: the job's store and reconfiguration driver."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="address the store listens on")
    p.add_argument("--port", type=int, default=int(os.environ.get("LIVESHARD_PORT", "29400")))
    p.add_argument("--job", default=os.environ.get("LIVESHARD_JOB", "job"))
    p.add_argument("--model", required=True)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--source", choices=("store", "kubernetes"), default="store",
                   help="where plans come from: the local driver (store) or the job's status")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "default"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from liveshard.runtime.control.store import JobStore, serve_store
    from liveshard.runtime.coordinator import Coordinator, StorePlanSource
    from liveshard.runtime.spec import load_model

    spec = load_model(args.model)
    store = JobStore(serve_store(args.host, args.port), args.job)
    if args.source == "kubernetes":
        from liveshard.runtime.kube_source import KubePlanSource

        source = KubePlanSource(store, args.job, args.namespace)
    else:
        source = StorePlanSource(store)
    coordinator = Coordinator(store, spec, source, global_batch=args.global_batch,
                              micro_batch=args.micro_batch, heartbeat_timeout=args.heartbeat_timeout)
    coordinator.run()
    return 0
