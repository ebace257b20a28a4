"""The validating admission webhook: what the CRD schema and its CEL rules cannot say.

The schema checks types, ranges and cross-field rules at the API server, and its transition rules
keep some fields fixed once the job exists (``FIXED_FIELDS``: this refuses the same edits with the
same words); this checks the model
itself (a valid ModelSpec, a known preset), that the parallelism constraints fit it, and what
this operator refuses (``policy.refusal``: hostPath checkpoints). The job loop checks the same
and reports a problem in the job's status, so the webhook only makes the refusal come earlier,
at ``kubectl apply``.

It is an HTTPS server of its own (kopf's ``WebhookServer`` with a supplied certificate, e.g. a
cert-manager Secret mounted into the pod; it re-reads the files when they are renewed), not a
kopf admission handler: every replica serves it, the leader and the ones waiting for the lease
alike, and the operator never writes webhook configurations (the Helm chart makes the
``ValidatingWebhookConfiguration``), so it needs no RBAC for them.
"""

from __future__ import annotations

import logging
from typing import Any

from liveshard.operator import kueue
from liveshard.operator.options import Options
from liveshard.operator.policy import JobPolicy, refusal
from liveshard.runtime.contract.jobspec import deprecated_fields, validate_spec

logger = logging.getLogger("liveshard.operator.admission")

REVIEW_PATH = "/validate"  # where the chart's webhook configuration sends reviews (any path is served)
REVIEW_API_VERSION = "admission.k8s.io/v1"


def job_problem(spec: Any, policy: JobPolicy) -> str | None:
    """The first problem with a job's spec, as one line naming the field and the fix, or None."""
    spec = spec if isinstance(spec, dict) else {}
    problem = validate_spec(spec)
    if problem is None:
        refused = refusal(spec, policy)
        problem = str(refused) if refused is not None else None
    return problem


# What an update may not change, each with the CRD's transition rule's message (a test checks they
# agree): the API server refuses these edits by its CEL rules, and this webhook by the same words,
# so a server without CEL transition rules refuses them too.
TRAINING_FIXED = ("training is fixed once the job is created (its pods train with the spec they started with, "
                  "so an edit would be ignored): to train longer or with other settings, create a new job whose "
                  "training.resume.path names this job's newest checkpoint (status.checkpoints.latest.path)")
FIXED_FIELDS: dict[tuple[str, ...], str] = {
    ("model",): "model is immutable: start a new job to train another model",
    ("workers", "gpusPerWorker"): "workers.gpusPerWorker is immutable",
    ("training",): TRAINING_FIXED,
    ("network",): "network is fixed when the job starts (the job's NetworkPolicies are made from it): "
                  "start a new job to change it",
}
_ABSENT = object()


def edit_problem(old: Any, new: Any) -> str | None:
    """Why an update from spec ``old`` to spec ``new`` is refused (one line naming the field), or
    None: every field of ``FIXED_FIELDS`` keeps its value (present or absent alike)."""
    for path, message in FIXED_FIELDS.items():
        before, after = _at(old, path), _at(new, path)
        if before is not _ABSENT and before != after:
            return f"spec.{'.'.join(path)}: {message}"
        if before is _ABSENT and after is not _ABSENT and path == ("network",):
            return f"spec.{'.'.join(path)}: {message}"
    return None


def _at(spec: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(spec, dict) or key not in spec:
            return _ABSENT
        spec = spec[key]
    return spec


def review(body: Any, policy: JobPolicy) -> dict[str, Any]:
    """Answer an AdmissionReview request (``admission.k8s.io/v1``) about an ElasticTrainingJob.

    Only a CREATE, or an UPDATE that changes the spec, is judged: an update of metadata alone
    (kopf's finalizer and annotations, labels) is always allowed, so a job that was accepted
    stays manageable and deletable whatever the checks say today."""
    request = body.get("request") if isinstance(body, dict) else None
    if not isinstance(request, dict):
        raise ValueError("the body is not an AdmissionReview with a request")
    problem, warnings = None, []
    operation = request.get("operation")
    new, old = request.get("object") or {}, request.get("oldObject") or {}
    if not request.get("subResource") and (
            operation == "CREATE" or (operation == "UPDATE" and new.get("spec") != old.get("spec"))):
        if operation == "UPDATE":
            problem = edit_problem(old.get("spec"), new.get("spec"))
        problem = problem or job_problem(new.get("spec"), policy) or kueue.workload_problem(new)
        warnings = deprecated_fields(new.get("spec"))  # kubectl prints each as "Warning: ..."
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": problem is None}
    if problem is not None:
        response["status"] = {"code": 422, "reason": "Invalid", "message": problem}
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": body.get("apiVersion") or REVIEW_API_VERSION, "kind": "AdmissionReview",
            "response": response}


async def serve(options: Options) -> None:
    """Serve the webhook over HTTPS until cancelled."""
    import aiohttp.web
    import kopf

    server = kopf.WebhookServer(addr=options.webhook_addr, port=options.webhook_port,
                                certfile=options.webhook_cert_file, pkeyfile=options.webhook_key_file)
    policy = options.policy

    async def handle(data: Any, **_: Any) -> dict[str, Any]:
        try:
            return review(data, policy)
        except ValueError as e:
            raise aiohttp.web.HTTPBadRequest(reason=str(e)) from None

    try:
        async for _ in server(handle):  # once per start, and again after a certificate renewal
            logger.info(f"serving the validating webhook on https://{options.webhook_addr}:{options.webhook_port}")
    except Exception as e:
        # The operator goes on without it (the job loop makes the same checks); say why loudly.
        logger.error(f"the validating webhook stopped: {type(e).__name__}: {e} (--webhook-cert-file "
                     f"{options.webhook_cert_file}, --webhook-key-file {options.webhook_key_file})")
        raise


__all__ = ["FIXED_FIELDS", "REVIEW_PATH", "edit_problem", "job_problem", "review", "serve"]
