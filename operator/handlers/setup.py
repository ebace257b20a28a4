"""Operator start-up: settings, the API connection, the liveness probe, shutdown."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from liveshard.runtime.contract.crd import GROUP

STORAGE_PREFIX = GROUP


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    options = memo.context.options
    # The API server ends a watch after server_timeout; the client gives up on a silent stream
    # shortly after, so a half-open connection never leaves the operator blind for long.
    settings.watching.server_timeout = options.watch_server_timeout
    settings.watching.client_timeout = options.watch_client_timeout
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 0.5
    settings.networking.request_timeout = 60
    # No start-up scan of CRDs and namespaces: the resources are known, and the scan needs
    # cluster-wide list rights (403 for ~55 s on a real server without them, no watch meanwhile).
    settings.scanning.disabled = True
    # Keep kopf's own bookkeeping out of the job's status (the runtime reads that).
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=STORAGE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=STORAGE_PREFIX, key="last-handled-configuration")
    # Only warnings from kopf itself become Events; the job loop posts its own explicitly.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "liveshard-operator"
    settings.execution.max_workers = 8


@kopf.on.login()
def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf uses the very connection the operator's own client was built with."""
    config = memo.context.kube.api.configuration
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, token = (header.split(" ", 1) if header and " " in header else (None, header))
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None,
        scheme=scheme, token=token, certificate_path=config.cert_file, private_key_path=config.key_file,
    )


@kopf.on.probe(id="jobs")
def jobs_probe(memo: Any, **_: Any) -> int:
    """Reported by the liveness endpoint: the job loops running."""
    return memo.context.loops


@kopf.on.cleanup()
async def shutdown(memo: Any, **_: Any) -> None:
    memo.context.kube.close()
