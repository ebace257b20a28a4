"""Validating admission webhooks for the emulator, called as kube-apiserver's
``ValidatingAdmissionWebhook`` plugin calls them.

A ``ValidatingWebhookConfiguration`` stored in the emulator is checked on write the way the API
server checks it (``validate_configuration``). On each CREATE or UPDATE that passed the schema,
every webhook whose ``rules``, ``namespaceSelector`` and ``objectSelector`` match is sent an
``admission.k8s.io/v1`` AdmissionReview over HTTPS, trusting only its ``caBundle``, within its
``timeoutSeconds``:

* ``allowed: false`` refuses the request with the webhook's status code (400 when it gives none
  below 400) and ``admission webhook "NAME" denied the request: MESSAGE``;
* each of the response's ``warnings`` becomes a ``Warning: 299`` header (kubectl prints it);
* a webhook that cannot be called, answers late, or answers with another request's ``uid`` is
  skipped under ``failurePolicy: Ignore`` and, under ``Fail`` (the default), refuses the
  request with 500 ``failed calling webhook "NAME": ...``.

The emulator has no Service network: a webhook given as ``clientConfig.service`` cannot be
called here (a call failure, as above). The local cluster registers the operator's webhook by
``clientConfig.url``. Not emulated: ``matchConditions`` (CEL), mutating webhooks, reviews of
DELETE and CONNECT, ``reinvocationPolicy``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import ssl
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

REVIEW_VERSION = "admission.k8s.io/v1"
DEFAULT_TIMEOUT_SECONDS = 10
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$")
_OPERATIONS = {"CREATE", "UPDATE", "DELETE", "CONNECT", "*"}


@dataclass
class Verdict:
    """What the webhooks said about one request: refused (HTTP code and message) or not, and
    the warnings to pass on."""

    code: int | None = None
    message: str = ""
    reason: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return self.code is None


# ---- the configuration object ---------------------------------------------------------------
def validate_configuration(obj: Mapping[str, Any]) -> list[str]:
    """The API server's checks of a ValidatingWebhookConfiguration, as ``field: problem`` lines
    (empty: valid)."""
    problems: list[str] = []
    hooks = obj.get("webhooks") or []
    if not isinstance(hooks, list):
        return ["webhooks: Invalid value: must be a list"]
    seen: set[str] = set()
    for i, hook in enumerate(hooks):
        at = f"webhooks[{i}]"
        if not isinstance(hook, dict):
            problems.append(f"{at}: Invalid value: must be an object")
            continue
        name = str(hook.get("name") or "")
        if not name:
            problems.append(f"{at}.name: Required value")
        elif not _NAME.match(name) or name.count(".") < 2:
            problems.append(f'{at}.name: Invalid value: "{name}": should be a domain with at least three segments '
                            "separated by dots")
        elif name in seen:
            problems.append(f'{at}.name: Duplicate value: "{name}"')
        seen.add(name)
        if hook.get("sideEffects") not in ("None", "NoneOnDryRun"):
            problems.append(f'{at}.sideEffects: Unsupported value: {json.dumps(hook.get("sideEffects"))}: '
                            'supported values: "None", "NoneOnDryRun"')
        versions = hook.get("admissionReviewVersions") or []
        if "v1" not in versions:
            problems.append(f"{at}.admissionReviewVersions: Invalid value: {json.dumps(versions)}: must include "
                            "at least one of v1")
        if (hook.get("failurePolicy") or "Fail") not in ("Ignore", "Fail"):
            problems.append(f"{at}.failurePolicy: Unsupported value: {json.dumps(hook.get('failurePolicy'))}: "
                            'supported values: "Fail", "Ignore"')
        timeout = hook.get("timeoutSeconds")
        timeout = DEFAULT_TIMEOUT_SECONDS if timeout is None else timeout
        if not isinstance(timeout, int) or isinstance(timeout, bool) or not 1 <= timeout <= 30:
            problems.append(f"{at}.timeoutSeconds: Invalid value: {timeout}: the timeout value must be between "
                            "1 and 30 seconds")
        problems += _client_config_problems(hook.get("clientConfig"), f"{at}.clientConfig")
        for j, rule in enumerate(hook.get("rules") or []):
            if not isinstance(rule, dict):
                problems.append(f"{at}.rules[{j}]: Invalid value: must be an object")
                continue
            bad = set(rule.get("operations") or []) - _OPERATIONS
            if bad:
                problems.append(f"{at}.rules[{j}].operations: Unsupported value: {sorted(bad)[0]!r}")
            if not rule.get("resources"):
                problems.append(f"{at}.rules[{j}].resources: Required value")
    return problems


def _client_config_problems(config: Any, at: str) -> list[str]:
    if not isinstance(config, dict):
        return [f"{at}: Required value"]
    problems = []
    url, service = config.get("url"), config.get("service")
    if bool(url) == bool(service):
        problems.append(f"{at}: Required value: exactly one of url or service is required")
    if url:
        parts = urlsplit(str(url))
        if parts.scheme != "https" or not parts.hostname:
            problems.append(f'{at}.url: Invalid value: "{url}": must be an https URL with a host')
        elif parts.query or parts.fragment or parts.username:
            problems.append(f'{at}.url: Invalid value: "{url}": query, fragment and user info are not permitted')
    bundle = config.get("caBundle")
    if bundle:
        try:
            base64.b64decode(str(bundle), validate=True)
        except (binascii.Error, ValueError):
            problems.append(f"{at}.caBundle: Invalid value: not base64")
    return problems


# ---- which webhooks a request reaches --------------------------------------------------------
def _selected(selector: Any, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions) over ``labels``; none selects all."""
    if not isinstance(selector, dict):
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _rule_matches(rule: Mapping[str, Any], group: str, version: str, plural: str, subresource: str | None,
                  operation: str, namespaced: bool) -> bool:
    def has(values: Any, value: str) -> bool:
        return "*" in (values or []) or value in (values or [])

    if not (has(rule.get("operations"), operation) and has(rule.get("apiGroups"), group)
            and has(rule.get("apiVersions"), version)):
        return False
    # as the API server's rule matcher: each entry is resource[/subresource]; "*" in either part
    # matches anything there, a subresource "*" the main resource too ("pods/*" matches pods)
    matched = False
    for entry in rule.get("resources") or []:
        res, _, sub = str(entry).partition("/")
        if res in ("*", plural) and sub in ("*", subresource or ""):
            matched = True
            break
    if not matched:
        return False
    scope = rule.get("scope") or "*"
    return scope == "*" or scope == ("Namespaced" if namespaced else "Cluster")


def matching(configs: list[Mapping[str, Any]], *, group: str, version: str, plural: str, subresource: str | None,
             operation: str, namespace: str | None, namespace_labels: Mapping[str, str],
             objects: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The webhooks of ``configs`` a request reaches, in the order the API server calls them
    (configurations by name, then their webhooks in order)."""
    out = []
    for config in sorted(configs, key=lambda c: (c.get("metadata") or {}).get("name", "")):
        for hook in config.get("webhooks") or []:
            if not any(isinstance(r, dict) and _rule_matches(r, group, version, plural, subresource, operation,
                                                             namespace is not None)
                       for r in hook.get("rules") or []):
                continue
            if namespace is not None and not _selected(hook.get("namespaceSelector"), namespace_labels):
                continue
            if not any(_selected(hook.get("objectSelector"), (o.get("metadata") or {}).get("labels") or {})
                       for o in objects if o):
                continue
            out.append(hook)
    return out


# ---- calling them ---------------------------------------------------------------------------
def review_request(*, kind: Mapping[str, str], resource: Mapping[str, str], subresource: str | None,
                   name: str, namespace: str | None, operation: str, new: Any, old: Any,
                   dry_run: bool) -> dict[str, Any]:
    """An AdmissionReview request as kube-apiserver sends it."""
    request: dict[str, Any] = {
        "uid": str(uuid.uuid4()), "kind": dict(kind), "resource": dict(resource),
        "requestKind": dict(kind), "requestResource": dict(resource), "name": name, "operation": operation,
        "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": new, "oldObject": old, "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1",
                    "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"}}
    if subresource:
        request["subResource"] = request["requestSubResource"] = subresource
    if namespace is not None:
        request["namespace"] = namespace
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "request": request}


class CallFailed(Exception):
    """The webhook could not be called or gave no valid answer."""


def _url(config: Mapping[str, Any]) -> str:
    if config.get("url"):
        return str(config["url"])
    svc = config.get("service") or {}
    raise CallFailed(f'failed to call webhook: service "{svc.get("namespace")}/{svc.get("name")}" cannot be '
                     "reached from the local cluster (it has no Service network: register the webhook by "
                     "clientConfig.url)")


_CONTEXTS: dict[str, ssl.SSLContext] = {}  # per caBundle: loading a CA costs more than the call


def _ssl_context(config: Mapping[str, Any]) -> ssl.SSLContext:
    bundle = str(config.get("caBundle") or "")
    if bundle not in _CONTEXTS:
        try:
            _CONTEXTS[bundle] = ssl.create_default_context(
                cadata=base64.b64decode(bundle).decode() if bundle else None)
        except (ValueError, ssl.SSLError) as e:
            raise CallFailed(f"failed to call webhook: the caBundle is not a PEM certificate: {e}") from None
    return _CONTEXTS[bundle]


async def call(hook: Mapping[str, Any], review: dict[str, Any]) -> dict[str, Any]:
    """POST ``review`` to ``hook``; its ``response`` (``CallFailed`` on any failure)."""
    config = hook.get("clientConfig") or {}
    url = _url(config)
    timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", DEFAULT_TIMEOUT_SECONDS)))
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                url, json=review, ssl=_ssl_context(config)) as reply:
            if reply.status != 200:
                raise CallFailed(f"failed to call webhook: the server responded with status {reply.status}")
            body = await reply.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError, ssl.SSLError) as e:
        raise CallFailed(f'failed to call webhook: Post "{url}": {type(e).__name__}: {e}') from None
    if not isinstance(body, dict) or body.get("apiVersion") != REVIEW_VERSION or body.get("kind") != "AdmissionReview":
        raise CallFailed(f"received invalid webhook response: expected {REVIEW_VERSION}, Kind=AdmissionReview")
    response = body.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("allowed"), bool):
        raise CallFailed("received invalid webhook response: no response.allowed")
    if response.get("uid") != review["request"]["uid"]:
        raise CallFailed(f"expected response.uid={review['request']['uid']!r}, got {response.get('uid')!r}")
    return response


async def admit(hooks: list[dict[str, Any]], review: dict[str, Any]) -> Verdict:
    """Call every one of ``hooks`` (the API server calls validating webhooks in parallel, so
    each one's warnings come back whatever the others say); the first refusal, or failing
    ``Fail`` webhook, is the verdict."""
    verdict = Verdict()
    for hook in hooks:
        name = str(hook.get("name"))
        try:
            response = await call(hook, review)
        except CallFailed as e:
            if (hook.get("failurePolicy") or "Fail") != "Ignore" and verdict.allowed:
                verdict.code, verdict.reason = 500, "InternalError"
                verdict.message = f'Internal error occurred: failed calling webhook "{name}": {e}'
            continue
        verdict.warnings += [str(w) for w in response.get("warnings") or []]
        if not response["allowed"] and verdict.allowed:
            status = response.get("status") if isinstance(response.get("status"), dict) else {}
            code = status.get("code") if isinstance(status.get("code"), int) else 0
            said = status.get("message") or status.get("reason")
            denied = f'admission webhook "{name}" denied the request'
            verdict.code = code if code >= 400 else 400
            verdict.message = f"{denied}: {said}" if said else f"{denied} without explanation"
            verdict.reason = str(status.get("reason") or "")
    return verdict
