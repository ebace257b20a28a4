"""A small Kubernetes API for tests and the embedded demo: kmock's emulator, made API-server-like.

``kmock.KubernetesEmulator`` (0.8) stores objects and serves list/watch/get/create/patch/delete,
but gives objects no ``resourceVersion``/``uid`` and keeps no rules. ``Emulator`` adds what kopf,
the kubernetes client and kubectl rely on, as kube-apiserver does it, and refuses what it refuses:

* metadata on create: ``uid``, ``resourceVersion``, ``creationTimestamp``, ``namespace``,
  ``generation``; ``generateName``; 201 with the object; 409 AlreadyExists;
* patches: JSON patch (a failed ``test`` op is 422), merge patch and, for built-in kinds,
  strategic merge patch (keyed lists such as ``conditions`` merge by ``type``; see
  ``_MERGE_KEYS``; custom resources refuse it with 415); a stale
  ``metadata.resourceVersion`` is 409 Conflict; no-op patches change nothing; ``generation``
  bumps when ``spec`` changes;
* PUT (replace) of a named object, e.g. a ``coordination.k8s.io`` Lease: the body replaces the
  object; a stale ``resourceVersion`` is 409 Conflict, none is an unconditional update, a name
  that differs from the URL's is 400, a missing object 404;
* the ``status`` subresource: ``/status`` writes only status, the main endpoint ignores status;
* the ``scale`` subresource of a registered CRD (``kubectl scale``, HPA): GET/PATCH/PUT;
* pods: the spec is immutable (bar container images, ``activeDeadlineSeconds`` and added
  tolerations: anything else is 422), a scheduler binds through ``pods/{name}/binding``
  (``create_namespaced_pod_binding(..., _preload_content=False)`` with the Python client);
  ``pods/{name}/log`` serves the container's output as text (``Emulator.pod_logs`` says where
  it is: the node agent's files);
* deletion: finalizers and ``deletionTimestamp``; a bound, unfinished pod is deleted
  gracefully: it stays (``Terminating``, ``deletionTimestamp`` = now + grace period) until its
  kubelet deletes it again with grace 0, and its name cannot be reused meantime (409);
  ``preconditions`` (uid, resourceVersion) are checked; background garbage collection by
  ownerReferences;
* list and watch: label and field selectors (field selectors only on the fields the API server
  indexes: ``field label not supported`` otherwise); a watch is JSON lines
  (``application/json``) from the given ``resourceVersion`` on (410 Expired when that is too
  old; none or ``"0"``: the current objects first, and with ``sendInitialEvents`` the BOOKMARK
  that ends them), with ADDED/DELETED when a change moves an object into or out of the
  selection, and ends after ``timeoutSeconds``;
* ``kubectl get``'s ``Accept: application/json;as=Table``: a Table with a CRD's
  ``additionalPrinterColumns`` (pods, nodes and events get kubectl's usual columns, anything
  else NAME and AGE), in lists, gets and watches;
* registered CRDs are enforced: defaults, ``openAPIV3Schema``, CEL rules (422 with the
  API server's style of message; crd_validation.py), and are served as
  ``customresourcedefinitions`` objects (a CRD created through the API is registered too);
* validating admission webhooks (admission.py): a stored ``ValidatingWebhookConfiguration``
  is checked as the API server checks it, and each CREATE or UPDATE that passed the schema is
  sent as an AdmissionReview to the webhooks it matches (``clientConfig.url`` over HTTPS,
  trusting only the ``caBundle``): a denial is the request's answer, warnings become
  ``Warning`` headers, an unreachable webhook refuses under ``failurePolicy: Fail``;
* field validation of custom resources (create, PUT, patch, ``/status``): fields the structural
  schema does not declare are pruned (not under ``x-kubernetes-preserve-unknown-fields``); with
  ``?fieldValidation=Strict`` they and duplicate JSON keys are a 400 BadRequest (``ElasticTrainingJob
  in version "v1alpha1" cannot be handled as a ElasticTrainingJob: strict decoding error: unknown
  field "spec.foo"``; a patch's message is from ``strict decoding error`` on), with ``Warn`` (the
  default) each is a ``Warning: 299 - "unknown field \\"spec.foo\\""`` header, ``Ignore`` is
  silent; ``?dryRun=All`` (and a DeleteOptions' ``dryRun``) answers without storing anything;
* ``/openapi/v3``: the index of every served group-version (``serverRelativeURL`` with the
  document's hash; an old hash is redirected) and per group-version documents: each resource's
  paths (collection, named object, ``/status``, ``/scale``; pods' ``/log`` and ``/binding``) with
  GET/POST/PUT/PATCH/DELETE operations carrying ``x-kubernetes-group-version-kind`` and the
  ``dryRun``/``fieldManager``/``fieldValidation`` query parameters (so kubectl validates on the
  server: ``kubectl apply`` without ``--validate=false``); a CRD's PATCH takes JSON patch, merge
  patch and apply patch (kubectl's ``apply`` then sends a JSON merge patch), a built-in kind's also
  strategic merge patch; ``components/schemas`` hold each CRD version's ``openAPIV3Schema`` as
  ``io.liveshard.v1alpha1.ElasticTrainingJob`` (``kubectl explain`` reads it) and its List; built-in
  kinds get placeholder schemas without a group-version-kind, so kubectl builds strategic merge
  patches from its compiled-in types. ``/openapi/v2`` is 404: kubectl asks for it only as a
  fallback and goes on without it;
* discovery fixed for the core group (``groupVersion: v1``; subresources carry no short
  names, or kubectl warns on every call); ``/version`` is v1.36, the server the operator was
  checked against; lists carry ``kind``/``apiVersion``.

Namespaces are lenient here: ``kubectl create namespace X`` (``POST /api/v1/namespaces``) and
``GET /api/v1/namespaces/X`` work as on a real server, ``/api/v1/namespaces`` lists ``default``,
those created and every namespace in use, but an object may be created in a namespace nobody
created (a real server refuses it: docs and examples create theirs). Still missing (don't depend
on it): paging (``limit`` returns everything), ``deletecollection``, the strategic merge of lists not in ``_MERGE_KEYS`` (e.g. ``finalizers``,
which a real server merges as a set), server-side apply (``application/apply-patch+yaml`` is
listed in /openapi/v3 as a real server lists it, but refused), ``/openapi/v2``, the built-in
kinds' schemas (no field validation for them), and kubelet/scheduler behaviour (pods stay Pending
until a test binds them; ``node_agent.py`` plays both in the local cluster).

``KubeEmulator`` runs it on a free loopback port in a background thread::

    with KubeEmulator(crds=["crds/elastictrainingjob.yaml"]) as kube:
        client = kube.api_client()            # kubernetes.client.ApiClient
        kube.write_kubeconfig(tmp / "kubeconfig")
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import contextvars
import copy
import datetime
import hashlib
import itertools
import json
import logging
import re
import secrets
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts as kmock_dicts

from liveshard.dev.localcluster import admission
from liveshard.dev.localcluster.crd_validation import CRDValidator, InvalidObject

_ACTIONS = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
_KEEP_REQUESTS = 16  # kmock records every request (see _handle)
_WATCH_HISTORY = 2_000  # events kept per resource for watches that resume from a resourceVersion
_WATCH_POLL = 2.0  # seconds between checks that a silent watch's client is still there
_POD_GRACE_DEFAULT = 30  # a pod's terminationGracePeriodSeconds when it sets none
_CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
_PODS = kmock.resource("", "v1", "pods")
_NODES = kmock.resource("", "v1", "nodes")
_EVENTS = kmock.resource("", "v1", "events")
_WEBHOOKS = kmock.resource("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations")
_CUSTOM_PATCHES = ("application/json-patch+json", "application/merge-patch+json")
_TRUE = ("true", "1", "True")
_FIELD_VALIDATIONS = ("Ignore", "Warn", "Strict")  # ?fieldValidation=; none is Warn
# per request (each runs in its own task): the Warning headers to send, and whether it is a dry run
_WARNINGS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("warnings", default=None)
_DRY_RUN_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("dry_run", default=False)

# The fields the API server can select on, beside metadata.name and metadata.namespace.
_SELECTABLE: dict[tuple[str, str], frozenset[str]] = {
    ("", "pods"): frozenset({"spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                             "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
                             "status.nominatedNodeName"}),
    ("", "events"): frozenset({"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                               "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                               "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"}),
    ("", "nodes"): frozenset({"spec.unschedulable"}),
    ("", "secrets"): frozenset({"type"}),
    ("", "namespaces"): frozenset({"status.phase"}),
}
_FIELD_ALIASES = {"source": "source.component"}  # events: the selector's name for the field

_POD_SPEC_FORBIDDEN = (
    "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,"
    "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)")


def _now(offset: float = 0.0) -> str:
    moment = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=offset)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# A 422's message as the API server words it: ``Kind[.group] "name" is invalid: field: problem; ...``
_INVALID = re.compile(r'(?P<kind>[A-Za-z]+)(?:\.(?P<group>[a-z0-9.-]+))? "(?P<name>[^"]*)" is invalid: (?P<rest>.*)',
                      re.DOTALL)
_CAUSE_REASONS = {"Required value": "FieldValueRequired", "Invalid value": "FieldValueInvalid",
                  "Unsupported value": "FieldValueNotSupported", "Forbidden": "FieldValueForbidden",
                  "Duplicate value": "FieldValueDuplicate", "Too long": "FieldValueTooLong",
                  "Too many": "FieldValueTooMany", "Not found": "FieldValueNotFound"}


def _error(status: int, reason: str, message: str, causes: list[str] | None = None) -> kmock.KubernetesError:
    """A Status error as the API server sends it. A 422 names the object (``details.kind``,
    ``name``, ``group``) and splits each cause into ``field`` and ``message``, which kubectl
    prints as ``The Kind "name" is invalid: field: message``; without them it prints ``The
    request is invalid: : field: ...``."""
    details: dict[str, Any] = {}
    named = _INVALID.fullmatch(message) if status == 422 else None
    if named is not None:
        details.update({"kind": named["kind"], "name": named["name"]},
                       **({"group": named["group"]} if named["group"] else {}))
        causes = causes or [named["rest"]]
    if causes:
        details["causes"] = [_cause(c) for c in causes]
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


def _cause(text: str) -> dict[str, str]:
    """``spec.workers: Invalid value: "object": ...`` as a StatusCause: field, message, reason."""
    field, sep, rest = text.partition(": ")
    if not sep or " " in field:
        return {"message": text}
    kind = next((r for prefix, r in _CAUSE_REASONS.items() if rest.startswith(prefix)), "FieldValueInvalid")
    return {"reason": kind, "message": rest, "field": field}


def _protobuf_fields(data: bytes) -> dict[int, list[Any]]:
    """The fields of one protobuf message: varints as ints, length-delimited ones as bytes."""
    out: dict[int, list[Any]] = defaultdict(list)
    i = 0

    def varint() -> int:
        nonlocal i
        value, shift = 0, 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number].append(varint())
        elif wire == 2:
            size = varint()
            out[number].append(data[i:i + size])
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
    return out


def _protobuf_object_name(data: bytes) -> str:
    """``metadata.name`` of an object in Kubernetes' protobuf envelope (``k8s\\0`` +
    runtime.Unknown, whose ``raw`` holds the object: field 1 its ObjectMeta, whose field 1 is
    the name)."""
    if not data.startswith(b"k8s\x00"):
        raise ValueError("not a Kubernetes protobuf object")
    raw = _protobuf_fields(data[4:])[2][0]
    return bytes(_protobuf_fields(_protobuf_fields(raw)[1][0])[1][0]).decode()


def _status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
    """A failure as a real server writes it (a ``Status`` object)."""
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "message": message, "reason": reason, "code": code}, status=code)


def _get_path(obj: dict[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.strip(".").split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


def _json_path(obj: Any, path: str) -> Any:
    """The value at a printer column's simple JSONPath (``.status.plan.config``, ``.a[0].b``)."""
    value = obj
    for name, index in re.findall(r"\.([^.\[\]]+)|\[(\d+)\]", path.strip().strip("{}")):
        if name:
            value = value.get(name) if isinstance(value, dict) else None
        else:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        if value is None:
            return None
    return value


def _human_duration(seconds: float) -> str:
    """k8s.io/apimachinery's ``duration.HumanDuration``: how kubectl prints an AGE."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours = s // 60, s // 3600
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _age(timestamp: Any) -> str | None:
    if not isinstance(timestamp, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return _human_duration((datetime.datetime.now(tz=datetime.UTC) - moment).total_seconds())


# ---- selectors -------------------------------------------------------------------------------
Matcher = Callable[[dict[str, Any]], bool]


def _split_selector(text: str) -> list[str]:
    """Split on the commas that are not inside ``in (a,b)`` parentheses."""
    terms, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


_SET_TERM = re.compile(r"^(\S+)\s+(in|notin)\s*\((.*)\)$")
_LABEL_KEY = re.compile(r"^([a-z0-9A-Z.\-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def label_selector(text: str) -> Matcher:
    """A ``labelSelector`` as the API server reads it; ValueError names a bad term."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_selector(text):
        if m := _SET_TERM.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
            continue
        m = re.match(r"^([^=!]+?)\s*(==|!=|=)\s*(.*)$", term)
        if m:
            key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        elif term.startswith("!"):
            key, op, value = term[1:].strip(), "!", ""
        else:
            key, op, value = term, "exists", ""
        if not _LABEL_KEY.match(key):
            raise ValueError(f"unable to parse requirement: invalid label key {key!r}")
        if op == "!=":
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif op in ("=", "=="):
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif op == "!":
            tests.append(lambda labels, k=key: k not in labels)
        else:
            tests.append(lambda labels, k=key: k in labels)
    return lambda obj: all(t((obj.get("metadata") or {}).get("labels") or {}) for t in tests)


def field_selector(text: str, resource: Any) -> Matcher:
    """A ``fieldSelector`` on the fields the API server can select on; ValueError otherwise."""
    allowed = {"metadata.name", "metadata.namespace"} | _SELECTABLE.get((resource.group, resource.plural), set())
    tests: list[tuple[str, str, bool]] = []
    for term in _split_selector(text):
        m = re.match(r"^([^=!]+)(==|!=|=)(.*)$", term)
        if not m:
            raise ValueError(f"invalid selector: {term!r}; can't understand {term!r}")
        field, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if field not in allowed:
            raise ValueError(f'field label not supported: {field}')
        tests.append((_FIELD_ALIASES.get(field, field) if resource.plural == "events" else field, value, op != "!="))

    def text_of(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return "" if value is None else str(value)

    return lambda obj: all((text_of(_get_path(obj, f)) == v) == eq for f, v, eq in tests)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the API server behaviour kopf and kubectl need (see module doc)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.validators: dict[Any, CRDValidator] = {}
        self.scale_paths: dict[Any, dict[str, str]] = {}
        self.printer_columns: dict[Any, list[dict[str, Any]]] = {}
        self.crd_versions: dict[Any, tuple[dict[str, Any], dict[str, Any]]] = {}  # resource -> (CRD, version)
        self._openapi: tuple[Any, dict[str, tuple[bytes, str]]] | None = None  # (what it was built from, docs)
        self._crd_generation = 0  # bumped by each register_crd: the OpenAPI documents change
        # (namespace, pod, uid, container) -> (log file, offset where this pod's output starts),
        # or None while it has not started; the local cluster's node agent answers it
        self.pod_logs: Callable[[str, str, str, str], tuple[Path, int] | None] | None = None
        self._rv = itertools.count(1)
        self._last_rv = 0
        # per resource: (resourceVersion, type, object, the object before) in order, for watches
        self._events: dict[Any, list[tuple[int, str, dict[str, Any], dict[str, Any] | None]]] = defaultdict(list)
        self._expired: dict[Any, int] = {}  # per resource: the newest resourceVersion no longer kept
        self._wake = asyncio.Event()
        self._started = _now()
        self._created_namespaces: dict[str, dict[str, Any]] = {}  # kubectl create namespace X

    # ---- CRDs -------------------------------------------------------------------------------
    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            subresources = set(version.get("subresources") or {})
            self.resources[res] = kmock.ResourceInfo(
                kind=spec["names"]["kind"], singular=spec["names"].get("singular"),
                namespaced=spec["scope"] == "Namespaced",
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                shortnames=set(spec["names"].get("shortNames") or ()),
                categories=set(spec["names"].get("categories") or ()),
                subresources=subresources,
            )
            self.validators[res] = CRDValidator(crd, version["name"])
            self.printer_columns[res] = list(version.get("additionalPrinterColumns") or [])
            self.crd_versions[res] = (copy.deepcopy(crd), copy.deepcopy(version))
            if "scale" in subresources:
                self.scale_paths[res] = version["subresources"]["scale"]
        self._crd_generation += 1
        # ... and served as an object, as `kubectl get crd` lists it
        key = (_CRDS, None, crd["metadata"]["name"])
        if key not in self._objects or self._objects[key].deleted:
            obj = copy.deepcopy(crd)
            obj["metadata"].update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(),
                                   creationTimestamp=_now(), generation=1)
            storage = next((v["name"] for v in spec["versions"] if v.get("storage")), spec["versions"][0]["name"])
            obj["status"] = {"acceptedNames": spec["names"], "storedVersions": [storage], "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": _now()}
                for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                ("Established", "InitialNamesAccepted", "the initial names have been accepted"))]}
            self._store(key, obj)
            self._emit(_CRDS, "ADDED", obj, None)

    def _has_status(self, resource: Any) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except KeyError:
            return False

    def _kind(self, resource: Any) -> str | None:
        try:
            return self.resources[resource].kind
        except KeyError:
            return None

    def _known(self, resource: Any) -> None:
        if resource not in self._get_resources():
            raise _error(404, "NotFound", "the server could not find the requested resource")

    # ---- request routing --------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock cannot parse the namespace collection's path (/api/v1/namespaces); kopf lists and
        # watches it when it runs for named namespaces.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            return await self._namespaces(raw_request)
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "POST":
            return await self._create_namespace(raw_request)
        one = re.fullmatch(r"/api/v1/namespaces/([^/]+)/?", raw_request.path)
        if one and raw_request.method == "GET":
            found = self._namespace_objects().get(one.group(1))
            if found is None:
                return _status_response(404, "NotFound", f'namespaces "{one.group(1)}" not found')
            return aiohttp.web.json_response(found)
        if raw_request.path.startswith("/openapi/v3") and raw_request.method in ("GET", "HEAD"):
            return self._serve_openapi(raw_request)
        return await super().__call__(raw_request)

    # ---- OpenAPI v3 ---------------------------------------------------------------------------
    def _openapi_docs(self) -> dict[str, tuple[bytes, str]]:
        """Per group-version key (``api/v1``, ``apis/liveshard.io/v1alpha1``): its OpenAPI v3
        document and the document's hash, rebuilt when the served resources change."""
        resources = sorted(self._get_resources(), key=lambda r: (r.group or "", r.version or "", r.plural or ""))
        basis = (tuple(resources), self._crd_generation)
        if self._openapi is not None and self._openapi[0] == basis:
            return self._openapi[1]
        docs: dict[str, dict[str, Any]] = {}
        for res in resources:
            if not res.plural or res.group is None or not res.version:
                continue
            info = self.resources.get(res)
            custom = res in self.crd_versions
            kind = (info.kind if info is not None else None) or res.plural.capitalize()
            verbs = set(info.verbs) if info is not None and info.verbs else {"get", "list", "watch"}
            verbs &= {"get", "list", "create", "update", "patch", "delete"}
            subresources = set(info.subresources) if info is not None else set()
            namespaced = bool(info.namespaced) if info is not None and info.namespaced is not None else True
            doc = docs.setdefault(_openapi_key(res.group, res.version), {
                "openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.36.0"}, "paths": {},
                "components": {"schemas": copy.deepcopy(_META_SCHEMAS)}})
            doc["paths"].update(_resource_paths(res.group, res.version, res.plural, kind, namespaced, verbs,
                                                subresources, custom))
            schemas = doc["components"]["schemas"]
            if custom:
                schemas.update(_crd_schemas(*self.crd_versions[res]))
            else:
                for name in (kind, f"{kind}List"):
                    schemas[_schema_name(res.group, res.version, name, False)] = _builtin_schema(
                        res.group, res.version, name)
            if "scale" in subresources:
                schemas["io.k8s.api.autoscaling.v1.Scale"] = copy.deepcopy(_SCALE_SCHEMA)
            if not res.group and res.plural == "pods":
                schemas["io.k8s.api.core.v1.Binding"] = _builtin_schema("", "v1", "Binding")
        built = {}
        for key, doc in docs.items():
            body = json.dumps(doc, sort_keys=True).encode()
            built[key] = (body, hashlib.sha512(body).hexdigest().upper())
        self._openapi = (basis, built)
        return built

    def _serve_openapi(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """``/openapi/v3``: the index of group-version documents, each named with its hash;
        ``/openapi/v3/<key>?hash=``: a document (immutable under its hash; an old hash is
        redirected to the current one, as kube-apiserver does)."""
        docs = self._openapi_docs()
        path = raw_request.path.rstrip("/")
        if path == "/openapi/v3":
            return aiohttp.web.json_response({"paths": {
                key: {"serverRelativeURL": f"/openapi/v3/{key}?hash={digest}"}
                for key, (_, digest) in sorted(docs.items())}}, headers={"Cache-Control": "no-cache, private"})
        key = path[len("/openapi/v3/"):]
        if key not in docs:
            return aiohttp.web.json_response({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 404,
                "reason": "NotFound", "message": "the server could not find the requested resource"}, status=404)
        body, digest = docs[key]
        asked = raw_request.query.get("hash")
        headers = {"Content-Type": "application/json", "ETag": f'"{digest}"', "Vary": "Accept"}
        if asked:
            if asked != digest:
                raise aiohttp.web.HTTPMovedPermanently(f"{path}?hash={digest}")
            expires = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(days=365)
            headers.update({"Cache-Control": "public, immutable",
                            "Expires": expires.strftime("%a, %d %b %Y %H:%M:%S GMT")})
        if raw_request.headers.get("If-None-Match") == f'"{digest}"':
            return aiohttp.web.Response(status=304, headers=headers)
        return aiohttp.web.Response(body=body, headers=headers)

    def _namespace_objects(self) -> dict[str, dict[str, Any]]:
        """``default``, the namespaces created (``kubectl create namespace``) and every one in use."""
        names = {"default", *(ns for _, ns, _ in self._objects if ns)}
        out = {n: {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": n, "uid": f"ns-{n}", "creationTimestamp": self._started}, "status": {"phase": "Active"}}
            for n in names}
        out.update(self._created_namespaces)
        return out

    async def _create_namespace(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """``POST /api/v1/namespaces``: a Namespace object (201), or AlreadyExists/Invalid as a
        real server answers."""
        data = await raw_request.read()
        try:
            if raw_request.content_type == "application/vnd.kubernetes.protobuf":  # kubectl create namespace
                body = {"metadata": {"name": _protobuf_object_name(data)}}
            else:
                body = json.loads(data or b"{}")
            name = str(((body.get("metadata") or {}).get("name")) or "")
        except (ValueError, AttributeError, IndexError):
            return _status_response(400, "BadRequest", "the body is not a Namespace")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            return _status_response(422, "Invalid", f'Namespace "{name}" is invalid: metadata.name: Invalid value: '
                                    f'"{name}": a lowercase RFC 1123 label must consist of lower case alphanumeric '
                                    "characters or '-', and must start and end with an alphanumeric character")
        if name in self._namespace_objects():
            return _status_response(409, "AlreadyExists", f'namespaces "{name}" already exists')
        obj = {"apiVersion": "v1", "kind": "Namespace",
               "metadata": {**(body.get("metadata") or {}), "name": name, "uid": str(uuid.uuid4()),
                            "resourceVersion": self._next_rv(), "creationTimestamp": _now()},
               "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        if raw_request.query.get("dryRun") != "All":
            self._created_namespaces[name] = obj
        return aiohttp.web.json_response(obj, status=201)

    async def _namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        items = [obj for _, obj in sorted(self._namespace_objects().items())]
        if raw_request.query.get("watch") not in _TRUE:
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": str(self._last_rv)},
                                              "items": items})
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        if raw_request.query.get("resourceVersion") in (None, "", "0"):
            for item in items:
                await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        # namespaces never change here: hold the stream until the client ends it or it times out
        timeout = float(raw_request.query.get("timeoutSeconds") or 0) or None
        end = asyncio.get_running_loop().time() + timeout if timeout else None
        while not _gone(raw_request) and (end is None or asyncio.get_running_loop().time() < end):
            await asyncio.sleep(min(_WATCH_POLL, end - asyncio.get_running_loop().time()) if end else _WATCH_POLL)
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock matches each request against its reactions by scanning every request recorded so
        # far: keep only the latest few, or each request costs O(requests served).
        del self._requests[:-_KEEP_REQUESTS]
        for errors in self._errors:
            del errors[:-10]
        if request.resource is None or not request.resource.plural:  # not an API object (discovery)
            return await super()._handle(request)
        method = str(request.method.value).upper() if request.method is not None else ""
        _WARNINGS.set([])
        _DRY_RUN_REQUEST.set(method in ("POST", "PUT", "PATCH", "DELETE") and bool(request.params.get("dryRun")))
        if method == "GET" and request.params.get("watch") in _TRUE:
            return await self._watch(request)
        if request.resource == _PODS and request.name and request.subresource == "log" and method == "GET":
            return await self._pod_log(request)
        if request.resource == _PODS and request.name and request.subresource == "binding" and method == "POST":
            async with self._lock:
                body = await self._bind(request)
            return aiohttp.web.json_response(body, status=201)
        if request.subresource == "scale" and request.name:
            return aiohttp.web.json_response(await self._scale(request))
        if method == "GET" and request.subresource is None and not request.name:
            return aiohttp.web.json_response(self._list(request))
        if request.method == kmock.method.PUT and request.name and request.subresource in (None, "status"):
            async with self._lock:
                body = await self._put(request)
            return _respond(body, 200)
        if request.action in _ACTIONS and request.subresource in (None, "status"):
            async with self._lock:
                if request.action == kmock.action.CREATE:
                    body, status = await self._create(request), 201
                elif request.action == kmock.action.UPDATE:
                    body, status = await self._patch(request), 200
                else:
                    body, status = await self._delete(request), 200
            return _respond(body, status)
        if request.action == kmock.action.FETCH and request.subresource in (None, "status"):
            key = (request.resource, request.namespace, request.name)
            if key not in self._objects or self._objects[key].deleted:
                raise _error(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
            obj = self._objects[key].raw
            if self._wants_table(request):
                return aiohttp.web.json_response(self._table(request, [obj], str(self._last_rv)))
            return aiohttp.web.json_response(obj)
        # Reads go straight to kmock's reactions: there must be no await between recording the
        # request and matching it (the list above is trimmed by concurrent requests).
        return await kmock.RawHandler._handle(self, request)

    # ---- list and watch ---------------------------------------------------------------------
    def _matcher(self, request: kmock.Request) -> Matcher:
        tests: list[Matcher] = []
        try:
            if request.params.get("labelSelector"):
                tests.append(label_selector(request.params["labelSelector"]))
            if request.params.get("fieldSelector"):
                tests.append(field_selector(request.params["fieldSelector"], request.resource))
        except ValueError as e:
            raise _error(400, "BadRequest", str(e)) from None
        namespace, name = request.namespace, request.name

        def match(obj: dict[str, Any]) -> bool:
            meta = obj.get("metadata") or {}
            return ((namespace is None or meta.get("namespace") == namespace)
                    and (name is None or meta.get("name") == name) and all(t(obj) for t in tests))
        return match

    def _current(self, resource: Any, match: Matcher) -> list[dict[str, Any]]:
        objs = [o.raw for (res, _, _), o in self._objects.items() if res == resource and not o.deleted]
        objs = [o for o in objs if match(o)]
        return sorted(objs, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"].get("name", "")))

    def _list(self, request: kmock.Request) -> dict[str, Any]:
        self._known(request.resource)
        match = self._matcher(request)
        rv = str(self._last_rv)  # the revision this list is consistent with: a watch goes on from it
        objs = self._current(request.resource, match)
        if self._wants_table(request):
            return self._table(request, objs, rv)
        kind = self._kind(request.resource)
        return {"kind": f"{kind}List" if kind else "List",
                "apiVersion": "/".join(p for p in (request.resource.group, request.resource.version) if p),
                "metadata": {"resourceVersion": rv}, "items": objs}

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        self._known(resource)
        match = self._matcher(request)
        table = self._wants_table(request)
        since_text = request.params.get("resourceVersion") or ""
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        initial: list[dict[str, Any]] = []
        streaming_list = request.params.get("sendInitialEvents") in _TRUE  # client-go's WatchList
        if since_text in ("", "0") or streaming_list:  # the current state first, then every change after it
            since = self._last_rv
            initial = [{"type": "ADDED", "object": o} for o in self._current(resource, match)]
            if streaming_list and request.params.get("allowWatchBookmarks") in _TRUE:
                kind = self._kind(resource) or ""
                initial.append({"type": "BOOKMARK", "object": {
                    "kind": kind, "apiVersion": "/".join(p for p in (resource.group, resource.version) if p),
                    "metadata": {"resourceVersion": str(since),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}})
        else:
            try:
                since = int(since_text)
            except ValueError:
                raise _error(400, "BadRequest", f"invalid resource version: {since_text}") from None
        raw = request._raw_request
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        if since < self._expired.get(resource, 0):
            await _write_event(response, {"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 410,
                "reason": "Expired", "message": f"too old resource version: {since} ({self._expired[resource]})"}})
            return response
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout if timeout else None
        pending = initial
        while True:
            for event in pending:
                if table and event["type"] != "BOOKMARK":
                    event = {"type": event["type"], "object": self._table(request, [event["object"]], None)}
                if not await _write_event(response, event):
                    return response
            wake = self._wake
            log = self._events[resource]
            start = bisect.bisect_right(log, since, key=lambda e: e[0])
            pending = []
            for rv, kind, obj, old in log[start:]:
                since = rv
                now_in, was_in = match(obj), old is not None and match(old)
                if kind == "MODIFIED" and now_in != was_in:
                    kind = "ADDED" if now_in else "DELETED"  # moved into or out of the selection
                if now_in or (kind == "DELETED" and was_in):
                    pending.append({"type": kind, "object": obj})
            if pending:
                continue
            left = None if end is None else end - loop.time()
            if (left is not None and left <= 0) or _gone(raw):
                return response
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), min(_WATCH_POLL, left) if left is not None else _WATCH_POLL)

    def _emit(self, resource: Any, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """Record a change for the watches (every change has its own resourceVersion)."""
        log = self._events[resource]
        log.append((int(obj["metadata"]["resourceVersion"]), kind, obj, old))
        if len(log) > _WATCH_HISTORY:
            drop = len(log) // 2
            self._expired[resource] = log[drop - 1][0]
            del log[:drop]
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def _next_rv(self) -> str:
        self._last_rv = next(self._rv)
        return str(self._last_rv)

    # ---- tables (kubectl get) -----------------------------------------------------------------
    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        accept = request.headers.get("Accept") or ""
        return any("as=Table" in part and "g=meta.k8s.io" in part for part in accept.split(","))

    def _table(self, request: kmock.Request, objs: list[dict[str, Any]], rv: str | None) -> dict[str, Any]:
        columns, cells = self._printer(request.resource)
        include = request.params.get("includeObject") or "Metadata"
        rows = []
        for obj in objs:
            row: dict[str, Any] = {"cells": cells(obj)}
            if include == "Object":
                row["object"] = obj
            elif include == "Metadata":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": obj.get("metadata") or {}}
            rows.append(row)
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": rv} if rv else {},
                "columnDefinitions": columns, "rows": rows}

    def _printer(self, resource: Any) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], list[Any]]]:
        """The Table's columns (Name first but for events, as the API server's) and their cells."""
        def column(name: str, kind: str = "string", priority: int = 0, description: str = "") -> dict[str, Any]:
            return {"name": name, "type": kind, "format": "name" if name == "Name" else "", "priority": priority,
                    "description": description}

        def name(obj: dict[str, Any]) -> str:
            return (obj.get("metadata") or {}).get("name", "")

        def age(obj: dict[str, Any]) -> str | None:
            return _age((obj.get("metadata") or {}).get("creationTimestamp"))

        if self.printer_columns.get(resource):
            crd_columns = self.printer_columns[resource]

            def crd_cells(obj: dict[str, Any]) -> list[Any]:
                out: list[Any] = [name(obj)]
                for c in crd_columns:
                    value = _json_path(obj, c["jsonPath"])
                    if c["type"] == "date":
                        value = _age(value)
                    elif isinstance(value, dict | list):
                        value = json.dumps(value)
                    out.append(value)
                return out
            return ([column("Name"), *(column(c["name"], c["type"], c.get("priority", 0), c.get("description", ""))
                                       for c in crd_columns)], crd_cells)
        if resource == _PODS:
            return ([column("Name"), column("Ready"), column("Status"), column("Restarts", "string"), column("Age"),
                     column("IP", priority=1), column("Node", priority=1)], lambda p: [
                name(p), _pod_ready(p), _pod_status(p),
                str(sum(int(c.get("restartCount") or 0) for c in (p.get("status") or {}).get("containerStatuses") or [])),
                age(p), (p.get("status") or {}).get("podIP") or "<none>", (p.get("spec") or {}).get("nodeName") or "<none>"])
        if resource == _NODES:
            return ([column("Name"), column("Status"), column("Roles"), column("Age"), column("Version")],
                    lambda n: [name(n), _node_status(n), "<none>", age(n), ""])
        if resource == _EVENTS:
            return ([column("Last Seen"), column("Type"), column("Reason"), column("Object"), column("Message"),
                     column("Name", priority=1)], lambda e: [
                _age(e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp")), e.get("type"),
                e.get("reason"), _event_object(e), e.get("message"), name(e)])
        return [column("Name"), column("Age")], lambda o: [name(o), age(o)]

    # ---- create / patch / delete ------------------------------------------------------------
    async def _create(self, request: kmock.Request) -> dict[str, Any]:
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if obj is None:
            raise _error(400, "BadRequest", "the request body is not a JSON object")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name: Required value")
        namespace = request.namespace or meta.get("namespace")
        key = (request.resource, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            # a Terminating object still holds its name
            raise _error(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
        if self._has_status(request.resource):
            obj.pop("status", None)  # status is written through /status only
        if request.resource == _PODS:
            obj["status"] = {"phase": "Pending"}
        if request.resource.plural == "secrets" and request.resource.group == "" and obj.get("stringData"):
            # as a real server: stringData is write-only, merged into data (base64)
            data = obj.setdefault("data", {})
            for k, v in obj.pop("stringData").items():
                data[k] = base64.b64encode(str(v).encode()).decode()
        directive = _field_validation(request, "CreateOptions")
        validator = self.validators.get(request.resource)
        if validator is not None:
            obj = _decoded(request, validator, obj, directive)
            obj = self._validated(validator, obj, None)
            meta = obj["metadata"]
        if namespace is not None:
            meta["namespace"] = namespace
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_owned, None)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(),
                    creationTimestamp=_now(), generation=1)
        obj.setdefault("kind", self._kind(request.resource))
        obj.setdefault("apiVersion", "/".join(p for p in (request.resource.group, request.resource.version) if p))
        self._check_builtin(request.resource, obj)
        await self._admit("CREATE", key, None, obj, None)
        if _DRY_RUN_REQUEST.get():
            return obj
        self._store(key, obj)
        self._emit(request.resource, "ADDED", obj, None)
        if request.resource == _CRDS:
            try:
                self.register_crd(obj)
            except (KeyError, TypeError, ValueError) as e:
                await self._remove(key, obj)
                raise _error(422, "Invalid", f"CustomResourceDefinition {meta['name']!r} is invalid: {e}") from None
        return obj

    async def _patch(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        directive = _field_validation(request, "PatchOptions")
        old = self._existing(key)
        if request.resource in self.validators:
            content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            if content_type not in _CUSTOM_PATCHES and not isinstance(request.data, list):
                raise _error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                             f"accepted media types include: {', '.join(_CUSTOM_PATCHES)}, "
                             "application/apply-patch+yaml")
        new = self._apply_patch(old, request)
        if request.resource in self.validators:
            new = _decoded(request, self.validators[request.resource], new, directive, patch=True)
        if request.subresource == "status":
            new = {**old, "status": new.get("status")} if "status" in new else {
                k: v for k, v in old.items() if k != "status"}
            new["metadata"] = dict(old["metadata"], **{k: v for k, v in new["metadata"].items()
                                                       if k == "resourceVersion"})
        else:
            if self._has_status(request.resource):
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = old["status"]
            self._check_pod_update(key, old, new)
        return await self._replace(key, old, new, admit=request.subresource or "")

    async def _put(self, request: kmock.Request) -> dict[str, Any]:
        """PUT: the body is the whole new object (``/status``: only its status counts)."""
        key = (request.resource, request.namespace, request.name)
        body = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if body is None:
            raise _error(400, "BadRequest", "the request body is not a JSON object")
        name = (body.get("metadata") or {}).get("name")
        if name is not None and name != request.name:
            raise _error(400, "BadRequest", f"the name of the object ({name}) does not match the name on the URL "
                         f"({request.name})")
        directive = _field_validation(request, "UpdateOptions")
        if request.resource in self.validators:
            body = _decoded(request, self.validators[request.resource], body, directive)
        old = self._existing(key)
        if request.subresource == "status":
            new = {k: v for k, v in old.items() if k != "status"}
            if "status" in body:
                new["status"] = body["status"]
        else:
            new = body
            if self._has_status(request.resource):
                new.pop("status", None)
                if "status" in old:
                    new["status"] = old["status"]
            self._check_pod_update(key, old, new)
        sent = dict(body.get("metadata") or {})
        if request.subresource == "status":  # of the body's metadata only the resourceVersion counts
            new["metadata"] = {k: v for k, v in old["metadata"].items() if k != "resourceVersion"}
            if "resourceVersion" in sent:
                new["metadata"]["resourceVersion"] = sent["resourceVersion"]
        else:  # what the body's metadata says goes; the server's own fields are kept (_replace)
            new["metadata"] = sent
        new.setdefault("kind", old.get("kind"))
        new.setdefault("apiVersion", old.get("apiVersion"))
        return await self._replace(key, old, new, admit=request.subresource or "")

    @staticmethod
    def _check_pod_update(key: Any, old: dict[str, Any], new: dict[str, Any]) -> None:
        """A pod's spec is immutable but for images, activeDeadlineSeconds and added tolerations."""
        if key[0] != _PODS:
            return
        before, after = copy.deepcopy(old.get("spec") or {}), copy.deepcopy(new.get("spec") or {})
        # scheduling gates may only be removed (validateOnlyDeletedSchedulingGates)
        had = {g.get("name") for g in before.pop("schedulingGates", None) or []}
        for i, gate in enumerate(after.pop("schedulingGates", None) or []):
            if gate.get("name") not in had:
                problem = (f"spec.schedulingGates[{i}].name: Forbidden: only deletion is allowed, but found new "
                           f"scheduling gate '{gate.get('name')}'")
                raise _error(422, "Invalid", f'Pod "{key[2]}" is invalid: {problem}', [problem])
        for spec in (before, after):
            spec.pop("activeDeadlineSeconds", None)
            for field in ("containers", "initContainers"):
                for container in spec.get(field) or []:
                    container.pop("image", None)
        old_tolerations, new_tolerations = before.pop("tolerations", None) or [], after.pop("tolerations", None) or []
        if before != after or any(t not in new_tolerations for t in old_tolerations):
            raise _error(422, "Invalid", f'Pod "{key[2]}" is invalid: spec: Forbidden: {_POD_SPEC_FORBIDDEN}',
                         [f"spec: Forbidden: {_POD_SPEC_FORBIDDEN}"])

    async def _replace(self, key: Any, old: dict[str, Any], new: dict[str, Any],
                       admit: str | None = None) -> dict[str, Any]:
        """Store ``new`` in place of ``old``; ``admit``: a user's update (``""``, or the
        subresource written) that the admission webhooks review."""
        resource = key[0]
        meta = new.setdefault("metadata", {})
        sent_rv = meta.get("resourceVersion")
        if sent_rv is not None and sent_rv != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on {resource.plural} "{key[2]}": '
                         "the object has been modified; please apply your changes to the latest version")
        for server_owned in ("uid", "name", "namespace", "creationTimestamp", "generation", "resourceVersion",
                             "deletionTimestamp", "deletionGracePeriodSeconds"):
            if server_owned in old["metadata"]:
                meta[server_owned] = old["metadata"][server_owned]
            else:
                meta.pop(server_owned, None)
        if new.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        validator = self.validators.get(resource)
        if validator is not None and new != old:
            new = self._validated(validator, new, old)
        if new == old:
            return old  # a no-op patch changes nothing, not even the resourceVersion
        self._check_builtin(resource, new)
        if admit is not None:
            await self._admit("UPDATE", key, admit or None, new, old)
        if _DRY_RUN_REQUEST.get():
            return new
        new["metadata"]["resourceVersion"] = self._next_rv()
        if _removable(new):
            await self._remove(key, new, old)
            return new
        self._store(key, new)
        self._emit(resource, "MODIFIED", new, old)
        return new

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        """kmock's Status for an error, with the request's warnings as ``Warning`` headers (a
        webhook's warnings come back beside its refusal) and an empty reason kept empty."""
        response = await super()._render_error(exc)
        if isinstance(exc, kmock.KubernetesError) and exc.reason == "" and isinstance(response, aiohttp.web.Response):
            body = json.loads(response.body)
            body["reason"] = ""
            response = aiohttp.web.json_response(body, status=response.status)
        return _with_warnings(response)

    # ---- admission ----------------------------------------------------------------------------
    @staticmethod
    def _check_builtin(resource: Any, obj: dict[str, Any]) -> None:
        """The API server's own validation of the built-in kinds the emulator acts on."""
        if resource == _WEBHOOKS:
            problems = admission.validate_configuration(obj)
            if problems:
                name = (obj.get("metadata") or {}).get("name")
                raise _error(422, "Invalid", f'ValidatingWebhookConfiguration.admissionregistration.k8s.io "{name}" '
                             f"is invalid: {', '.join(problems)}", problems)

    async def _admit(self, operation: str, key: Any, subresource: str | None, new: dict[str, Any],
                     old: dict[str, Any] | None) -> None:
        """Send the request to the validating webhooks it matches (admission.py); refuse it if
        one denies it (or fails under ``failurePolicy: Fail``), pass on their warnings."""
        resource, namespace, name = key
        if resource.group == "admissionregistration.k8s.io":
            return  # the API server never sends webhook configurations to webhooks (no lock-out)
        configs = [o.raw for (res, _, _), o in self._objects.items() if res == _WEBHOOKS and not o.deleted]
        if not configs:
            return
        hooks = admission.matching(
            configs, group=resource.group or "", version=resource.version or "", plural=resource.plural,
            subresource=subresource, operation=operation, namespace=namespace,
            namespace_labels={"kubernetes.io/metadata.name": namespace} if namespace else {},
            objects=[new, old or {}])
        if not hooks:
            return
        review = admission.review_request(
            kind={"group": resource.group or "", "version": resource.version or "", "kind": self._kind(resource) or ""},
            resource={"group": resource.group or "", "version": resource.version or "", "resource": resource.plural},
            subresource=subresource, name=name, namespace=namespace, operation=operation,
            new=copy.deepcopy(new), old=copy.deepcopy(old), dry_run=_DRY_RUN_REQUEST.get())
        verdict = await admission.admit(hooks, review)
        warnings = _WARNINGS.get()
        if warnings is not None:
            warnings.extend(verdict.warnings)
        if not verdict.allowed:
            assert verdict.code is not None
            raise _error(verdict.code, verdict.reason, verdict.message)

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        old = self._existing(key)
        options = request.data if isinstance(request.data, dict) else {}
        preconditions = options.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            wanted, actual = preconditions.get(field), old["metadata"].get(field)
            if wanted is not None and wanted != actual:
                label = {"uid": "UID", "resourceVersion": "ResourceVersion"}[field]
                raise _error(409, "Conflict", f"Precondition failed: {label} in precondition: {wanted}, "
                             f"{label} in object meta: {actual}")
        grace = None
        if key[0] == _PODS:
            asked = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
            grace = _pod_grace(old, None if asked is None else int(asked))
        if _DRY_RUN_REQUEST.get() or options.get("dryRun"):  # kubectl says so in the DeleteOptions
            return old
        return await self._mark_deleted(key, old, grace)

    async def _mark_deleted(self, key: Any, old: dict[str, Any], grace: int | None) -> dict[str, Any]:
        """Start deleting an object: gone at once unless finalizers or a pod's grace period hold it."""
        meta = old["metadata"]
        if meta.get("deletionTimestamp"):
            current = meta.get("deletionGracePeriodSeconds")
            if grace is None or current is None or grace >= current:
                return old  # already being deleted, at least as soon
        new = copy.deepcopy(old)
        new["metadata"]["deletionTimestamp"] = _now(grace or 0)
        if grace is not None:
            new["metadata"]["deletionGracePeriodSeconds"] = grace
        new["metadata"]["resourceVersion"] = self._next_rv()
        if _removable(new):
            await self._remove(key, new, old)
        else:
            self._store(key, new)
            self._emit(key[0], "MODIFIED", new, old)
        return new

    async def _remove(self, key: Any, last: dict[str, Any], before: dict[str, Any] | None = None) -> None:
        self._objects[key].history.append(None)
        self._emit(key[0], "DELETED", last, before)
        await self._collect_dependents(last["metadata"].get("uid"))

    async def _collect_dependents(self, owner_uid: str | None) -> None:
        """Background cascading deletion: objects owned by a removed object go too (pods with
        their grace period, as the garbage collector deletes them)."""
        if not owner_uid:
            return
        for key, obj in list(self._objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                dependent = copy.deepcopy(obj.raw)
                await self._mark_deleted(key, dependent, _pod_grace(dependent, None) if key[0] == _PODS else None)

    # ---- pods: binding and logs ---------------------------------------------------------------
    async def _bind(self, request: kmock.Request) -> dict[str, Any]:
        """``POST pods/{name}/binding``: what a scheduler does (the pod's spec is immutable)."""
        body = request.data if isinstance(request.data, dict) else {}
        node = (body.get("target") or {}).get("name")
        if not node:
            raise _error(422, "Invalid", f'Binding.core "{request.name}" is invalid: target.name: Required value')
        key = (request.resource, request.namespace, request.name)
        old = self._existing(key)
        uid = (body.get("metadata") or {}).get("uid")
        if uid and uid != old["metadata"]["uid"]:  # a binding made for a pod since deleted and recreated
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{request.name}": '
                         f"The UID in the precondition ({uid}) does not match the UID in record "
                         f"({old['metadata']['uid']}). The object might have been deleted and then recreated")
        if old["metadata"].get("deletionTimestamp"):
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{request.name}": '
                         f"pod {request.name} is being deleted, cannot be assigned to a host")
        if (old.get("spec") or {}).get("nodeName"):
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{request.name}": '
                         f'pod {request.name} is already assigned to node "{old["spec"]["nodeName"]}"')
        if (old.get("spec") or {}).get("schedulingGates"):  # not ready for scheduling
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{request.name}": '
                         f"pod {request.name} has non-empty .spec.schedulingGates")
        new = copy.deepcopy(old)
        new.setdefault("spec", {})["nodeName"] = node
        status = new.setdefault("status", {})
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"] + [
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": _now()}]
        await self._replace(key, old, new)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    async def _pod_log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """``GET pods/{name}/log``: the container's output as text (``follow``, ``tailLines``,
        ``limitBytes``), read from where ``pod_logs`` says the kubelet keeps it."""
        key = (request.resource, request.namespace, request.name)
        pod = self._existing(key)
        containers = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        container = request.params.get("container")
        if not container:
            if len(containers) != 1:
                raise _error(400, "BadRequest", f"a container name must be specified for pod {request.name}, "
                             f"choose one of: [{' '.join(containers)}]")
            container = containers[0]
        if container not in containers:
            raise _error(400, "BadRequest", f"container {container} is not valid for pod {request.name}")
        if request.params.get("previous") in _TRUE:
            raise _error(400, "BadRequest", f'previous terminated container "{container}" in pod '
                         f'"{request.name}" not found')
        uid = pod["metadata"]["uid"]
        found = self.pod_logs(request.namespace, request.name, uid, container) if self.pod_logs else None
        if found is None or not found[0].exists():
            raise _error(400, "BadRequest", f'container "{container}" in pod "{request.name}" is waiting to start: '
                         "ContainerCreating")
        path, offset = found
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
            offset += len(data)
        if request.params.get("tailLines"):
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(request.params["tailLines"]):]) if int(request.params["tailLines"]) else b""
        if request.params.get("limitBytes"):
            data = data[:int(request.params["limitBytes"])]
        if request.params.get("follow") not in _TRUE:
            return aiohttp.web.Response(body=data, content_type="text/plain")
        raw = request._raw_request
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(raw)
        await response.write(data)
        while not _gone(raw):
            current = self._objects[key] if key in self._objects else None  # noqa: SIM401 (no .get)
            alive = current is not None and not current.deleted and current.raw["metadata"]["uid"] == uid
            with open(path, "rb") as f:
                f.seek(offset)
                more = f.read()
            offset += len(more)
            if more:
                try:
                    await response.write(more)
                except ConnectionError:
                    break
            if not alive or (current.raw.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                break  # the container ended: so does the stream, as a kubelet's
            await asyncio.sleep(0.2)
        return response

    # ---- scale subresource ------------------------------------------------------------------
    async def _scale(self, request: kmock.Request) -> dict[str, Any]:
        paths = self.scale_paths.get(request.resource)
        if paths is None:
            raise _error(404, "NotFound", f"{request.resource.plural} has no scale subresource")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            old = self._existing(key)
            if request.method in ("PATCH", "PUT"):
                scale = self._scale_of(old, paths)
                if request.method == "PUT":
                    wanted = request.data if isinstance(request.data, dict) else {}
                else:
                    wanted = self._apply_patch(scale, request)
                replicas = (wanted.get("spec") or {}).get("replicas")
                if not isinstance(replicas, int) or replicas < 0:
                    raise _error(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
                new = copy.deepcopy(old)
                _set_path(new, paths["specReplicasPath"], replicas)
                old = await self._replace(key, old, new)
            return self._scale_of(old, paths)

    @staticmethod
    def _scale_of(obj: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _get_path(obj, paths["statusReplicasPath"]) or 0}
        selector = _get_path(obj, paths["labelSelectorPath"]) if paths.get("labelSelectorPath") else None
        if selector:
            status["selector"] = selector
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                              "creationTimestamp") if k in meta},
            "spec": {"replicas": _get_path(obj, paths["specReplicasPath"]) or 0},
            "status": status,
        }

    # ---- helpers ----------------------------------------------------------------------------
    def _existing(self, key: Any) -> dict[str, Any]:
        if key not in self._objects or self._objects[key].deleted:
            raise _error(404, "NotFound", f'{key[0].plural} "{key[2]}" not found')
        return copy.deepcopy(self._objects[key].raw)

    def _store(self, key: Any, obj: dict[str, Any]) -> None:
        if key in self._objects:
            history = self._objects[key].history
            history.append(obj)
            del history[:-1]
        else:
            self._objects[key] = obj

    @staticmethod
    def _apply_patch(old: dict[str, Any], request: kmock.Request) -> dict[str, Any]:
        body = request.data
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        if isinstance(body, list) or content_type == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(copy.deepcopy(old), body or [], in_place=False)
            except jsonpatch.JsonPatchTestFailed as e:
                raise _error(422, "Invalid", f"the server rejected our request due to an error in our "
                             f"request: test operation failed: {e}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise _error(422, "Invalid", f"invalid JSON patch: {e}") from None
        if not isinstance(body, dict):
            raise _error(400, "BadRequest", "the patch body is neither a JSON object nor a JSON patch")
        if content_type == "application/strategic-merge-patch+json":
            return _strategic_merge(old, body)
        return dict(kmock_dicts.merge_patch_dict(copy.deepcopy(old), body))

    @staticmethod
    def _validated(validator: CRDValidator, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        try:
            return validator.validate(obj, old)
        except InvalidObject as e:
            raise _error(422, "Invalid", str(e), e.errors) from None

    # ---- discovery --------------------------------------------------------------------------
    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        # kmock gives a subresource its resource's short names: kubectl then warns on every
        # call that "etj" could also mean "elastictrainingjobs/status"
        for entry in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in entry.get("name", ""):
                sub = entry["name"].split("/", 1)[1]
                entry.update(shortNames=[], categories=[], singularName="")
                entry["verbs"] = {"log": ["get"], "binding": ["create"], "eviction": ["create"]}.get(
                    sub, ["get", "patch", "update"])
                if sub == "scale":
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return payload

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        # the version the operator was checked against; kubectl warns about a larger skew
        return {"major": "1", "minor": "36", "gitVersion": "v1.36.0", "gitCommit": "", "gitTreeState": "clean",
                "buildDate": "", "goVersion": "", "compiler": "gc", "platform": "linux/amd64"}


# ---- field validation ----------------------------------------------------------------------------
def _field_validation(request: kmock.Request, options: str) -> str:
    """The request's ``fieldValidation`` (Warn when it names none, as kube-apiserver since 1.27)."""
    value = request.params.get("fieldValidation") or "Warn"
    if value not in _FIELD_VALIDATIONS:
        supported = ", ".join(f'"{v}"' for v in ("", *sorted(_FIELD_VALIDATIONS)))
        raise _error(422, "Invalid", f'{options}.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: '
                     f'"{value}": supported values: {supported}',
                     [f'fieldValidation: Unsupported value: "{value}": supported values: {supported}'])
    return value


def _duplicate_fields(body: bytes) -> list[str]:
    """The keys given twice in one JSON object of a request body, in order (sigs.k8s.io/json's
    strict decoding names the key alone: ``duplicate field "replicas"``)."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            if k in seen and k not in found:
                found.append(k)
            seen.add(k)
        return dict(items)
    try:
        json.loads(body or b"null", object_pairs_hook=pairs)
    except ValueError:
        return []
    return found


def _decoded(request: kmock.Request, validator: CRDValidator, obj: dict[str, Any], directive: str,
             patch: bool = False) -> dict[str, Any]:
    """A custom resource as the API server decodes it: the fields its schema does not declare
    are pruned; with ``Strict`` they (and duplicate fields) are a 400, with ``Warn`` each is a
    ``Warning`` header (kubectl prints ``Warning: unknown field "spec.foo"``), ``Ignore`` says
    nothing."""
    pruned, unknown = validator.prune(obj)
    if directive == "Ignore":
        return pruned
    problems = [f'duplicate field "{k}"' for k in _duplicate_fields(request.body)
                if not patch or isinstance(request.data, dict)]
    problems += [f'unknown field "{p}"' for p in unknown]
    if problems and directive == "Strict":
        message = "strict decoding error: " + ", ".join(problems)
        if not patch:  # the create and update handlers' transformDecodeError
            kind = obj.get("kind") or validator.kind
            version = str(obj.get("apiVersion") or "").rpartition("/")[2] or validator.version
            message = f'{kind} in version "{version}" cannot be handled as a {validator.kind}: {message}'
        raise _error(400, "BadRequest", message)
    warnings = _WARNINGS.get()
    if warnings is not None:
        warnings.extend(problems)
    return pruned


def _respond(body: Any, status: int) -> aiohttp.web.StreamResponse:
    """A JSON response with the request's warnings as ``Warning: 299 - "..."`` headers."""
    return _with_warnings(aiohttp.web.json_response(body, status=status))


def _with_warnings(response: aiohttp.web.StreamResponse) -> aiohttp.web.StreamResponse:
    """``response`` with the request's warnings (``_WARNINGS``) as ``Warning: 299`` headers."""
    for text in _WARNINGS.get() or ():
        quoted = text.replace("\\", "\\\\").replace('"', '\\"')
        response.headers.add("Warning", f'299 - "{quoted}"')
    return response


# Lists that a strategic merge patch merges item by item, by this key (Kubernetes' patchMergeKey
# of those fields); any other list is replaced, as in a merge patch.
_MERGE_KEYS = {"conditions": "type", "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
               "env": "name", "volumes": "name", "volumeMounts": "mountPath", "ownerReferences": "uid",
               "imagePullSecrets": "name"}


def _strategic_merge(old: Any, patch: Any) -> Any:
    """A strategic merge patch, as far as liveshard's built-in objects need it: maps merge, null
    removes, the keyed lists of ``_MERGE_KEYS`` merge item by item (a Ready condition written
    without ``lastTransitionTime`` keeps the old one), ``$patch: delete``/``replace``."""
    if not isinstance(patch, dict):
        return _without_nulls(patch)
    if not isinstance(old, dict) or patch.get("$patch") == "replace":
        return _without_nulls({k: v for k, v in patch.items() if k != "$patch"})
    out = copy.deepcopy(old)
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $setElementOrder, $retainKeys: hints about order and pruning
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = _strategic_merge(out.get(key), value)
        elif isinstance(value, list) and key in _MERGE_KEYS and all(isinstance(i, dict) for i in value):
            out[key] = _merge_list(out.get(key) or [], value, _MERGE_KEYS[key])
        else:
            out[key] = _without_nulls(value)
    return out


def _merge_list(old: list[Any], patch: list[dict[str, Any]], key: str) -> list[Any]:
    if {"$patch": "replace"} in patch:
        return [_without_nulls(i) for i in patch if i != {"$patch": "replace"}]
    out = copy.deepcopy(old)
    for item in patch:
        at = next((i for i, o in enumerate(out) if isinstance(o, dict) and o.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if at is not None:
                out.pop(at)
        elif at is None:
            out.append(_without_nulls(item))
        else:
            out[at] = _strategic_merge(out[at], item)
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _gone(raw_request: Any) -> bool:
    """Has the client of a long request (a watch, a followed log) gone away?"""
    transport = getattr(raw_request, "transport", None)
    return transport is None or transport.is_closing()


async def _write_event(response: aiohttp.web.StreamResponse, event: dict[str, Any]) -> bool:
    try:
        await response.write(json.dumps(event).encode() + b"\n")
        return True
    except (ConnectionError, RuntimeError):  # the client went away
        return False


def _removable(obj: dict[str, Any]) -> bool:
    """Deleted, no finalizer holds it, and no grace period runs (a kubelet ends that one)."""
    meta = obj["metadata"]
    return bool(meta.get("deletionTimestamp")) and not meta.get("finalizers") \
        and not meta.get("deletionGracePeriodSeconds")


def _pod_grace(pod: dict[str, Any], asked: int | None) -> int:
    """The grace period of a pod's deletion, as the API server's pod strategy sets it."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0  # no kubelet runs it (not bound, or its containers are done): gone at once
    grace = asked if asked is not None else spec.get("terminationGracePeriodSeconds")
    grace = _POD_GRACE_DEFAULT if grace is None else int(grace)
    return 1 if grace < 0 else grace


def _pod_ready(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for c in statuses if c.get('ready'))}/{total}"


def _pod_status(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating"
    for c in status.get("containerStatuses") or []:
        state = c.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason"):
            return str(waiting["reason"])
        if terminated:  # as kubectl's printer: the reason (Completed, Error), else how it ended
            if terminated.get("reason"):
                return str(terminated["reason"])
            if terminated.get("signal"):
                return f"Signal:{terminated['signal']}"
            return f"ExitCode:{terminated.get('exitCode')}"
    return str(status.get("reason") or status.get("phase") or "Pending")


def _event_object(event: dict[str, Any]) -> str:
    involved = event.get("involvedObject") or {}
    return f"{str(involved.get('kind') or '').lower()}/{involved.get('name') or ''}"


def _node_status(node: dict[str, Any]) -> str:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
    text = {"True": "Ready", "False": "NotReady"}.get(ready or "", "Unknown")
    return text + (",SchedulingDisabled" if (node.get("spec") or {}).get("unschedulable") else "")


# ---- OpenAPI v3 -----------------------------------------------------------------------------
# What kubectl reads from /openapi/v3 (cli-runtime's QueryParamVerifierV3, kubectl apply's
# patcher): per group-version, the PATCH operation of each kind, found by its
# x-kubernetes-group-version-kind, with a fieldValidation query parameter (then kubectl leaves
# field validation to the server: ?fieldValidation=Strict) and a request body whose media types
# say whether a strategic merge patch is accepted (built-in kinds) or not (custom resources: kubectl
# sends a JSON merge patch). Custom resources' schemas are the CRDs' openAPIV3Schema, named as the
# API server names them (io.liveshard.v1alpha1.ElasticTrainingJob). Built-in kinds get paths but no
# schemas: kubectl then computes strategic merge patches from its compiled-in types.
_META = "io.k8s.apimachinery.pkg.apis.meta.v1"
_PATCH_TYPES_CUSTOM = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")
_PATCH_TYPES_BUILTIN = ("application/json-patch+json", "application/merge-patch+json",
                        "application/strategic-merge-patch+json", "application/apply-patch+yaml")
_RESPONSE_TYPES = ("application/json", "application/yaml")


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _query(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {"name": name, "in": "query", "description": description, "schema": {"type": kind, "uniqueItems": True}}


_Q_DRY_RUN = _query("dryRun", "When present, indicates that modifications should not be persisted. Valid values: All.")
_Q_FIELD_MANAGER = _query("fieldManager", "a name associated with the actor or entity that is making these changes.")
_Q_FIELD_VALIDATION = _query(
    "fieldValidation", "instructs the server on how to handle objects in the request (POST/PUT/PATCH) containing "
    "unknown or duplicate fields. Valid values are: Ignore, Warn (the default), Strict.")
_Q_FORCE = _query("force", "Force is going to \"force\" Apply requests.", "boolean")
_Q_GRACE = _query("gracePeriodSeconds", "The duration in seconds before the object should be deleted.", "integer")
_LIST_PARAMS = [_query("labelSelector", "A selector to restrict the list of returned objects by their labels."),
                _query("fieldSelector", "A selector to restrict the list of returned objects by their fields."),
                _query("resourceVersion", "the resource version to list or watch from."),
                _query("timeoutSeconds", "Timeout for the list/watch call.", "integer"),
                _query("watch", "Watch for changes to the described resources.", "boolean"),
                _query("allowWatchBookmarks", "requests watch events with type BOOKMARK.", "boolean"),
                _query("sendInitialEvents", "the watch starts with the current objects.", "boolean")]
_PATH_PARAMS = {
    "name": {"name": "name", "in": "path", "description": "name of the object", "required": True,
             "schema": {"type": "string", "uniqueItems": True}},
    "namespace": {"name": "namespace", "in": "path", "description": "object name and auth scope",
                  "required": True, "schema": {"type": "string", "uniqueItems": True}},
}
_Q_PRETTY = _query("pretty", "If 'true', then the output is pretty printed.")

_META_SCHEMAS: dict[str, Any] = {
    f"{_META}.ObjectMeta": {"type": "object", "description": "ObjectMeta is metadata that all persisted resources "
                            "must have.", "properties": {
        **{k: {"type": "string"} for k in ("name", "generateName", "namespace", "selfLink", "uid", "resourceVersion")},
        "generation": {"type": "integer", "format": "int64"},
        "creationTimestamp": {"type": "string", "format": "date-time"},
        "deletionTimestamp": {"type": "string", "format": "date-time"},
        "deletionGracePeriodSeconds": {"type": "integer", "format": "int64"},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
        "finalizers": {"type": "array", "items": {"type": "string", "default": ""},
                       "x-kubernetes-list-type": "set", "x-kubernetes-patch-strategy": "merge"},
        "ownerReferences": {"type": "array", "items": {"type": "object", "x-kubernetes-map-type": "atomic"},
                            "x-kubernetes-list-map-keys": ["uid"], "x-kubernetes-list-type": "map",
                            "x-kubernetes-patch-merge-key": "uid", "x-kubernetes-patch-strategy": "merge"},
        "managedFields": {"type": "array", "items": {"type": "object"}}}},
    f"{_META}.ListMeta": {"type": "object", "properties": {
        "continue": {"type": "string"}, "remainingItemCount": {"type": "integer", "format": "int64"},
        "resourceVersion": {"type": "string"}, "selfLink": {"type": "string"}}},
    f"{_META}.Status": {"type": "object", "description": "Status is a return value for calls that don't return "
                        "other objects.", "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "code": {"type": "integer", "format": "int32"},
        "message": {"type": "string"}, "reason": {"type": "string"}, "status": {"type": "string"},
        "details": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "metadata": {"allOf": [_ref(f"{_META}.ListMeta")], "default": {}}},
        "x-kubernetes-group-version-kind": [{"group": "", "kind": "Status", "version": "v1"}]},
    f"{_META}.DeleteOptions": {"type": "object", "description": "DeleteOptions may be provided when deleting an "
                               "API object.", "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "dryRun": {"type": "array", "items": {"type": "string", "default": ""}},
        "gracePeriodSeconds": {"type": "integer", "format": "int64"},
        "preconditions": {"type": "object", "properties": {"resourceVersion": {"type": "string"},
                                                           "uid": {"type": "string"}}},
        "propagationPolicy": {"type": "string"}}},
    f"{_META}.Patch": {"type": "object", "description": "Patch is provided to give a concrete name and type to the "
                       "Kubernetes PATCH request body."},
}
_SCALE_SCHEMA = {"type": "object", "description": "Scale represents a scaling request for a resource.", "properties": {
    "apiVersion": {"type": "string"}, "kind": {"type": "string"},
    "metadata": {"allOf": [_ref(f"{_META}.ObjectMeta")], "default": {}},
    "spec": {"type": "object", "properties": {"replicas": {"type": "integer", "format": "int32"}}, "default": {}},
    "status": {"type": "object", "properties": {"replicas": {"type": "integer", "format": "int32", "default": 0},
                                                "selector": {"type": "string"}}, "default": {}}},
    "x-kubernetes-group-version-kind": [{"group": "autoscaling", "kind": "Scale", "version": "v1"}]}


def _openapi_key(group: str, version: str) -> str:
    """The group-version's key in /openapi/v3's paths (``api/v1``, ``apis/liveshard.io/v1alpha1``)."""
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _schema_name(group: str, version: str, kind: str, custom: bool) -> str:
    """How the API server names a kind's schema: custom resources by their reversed group
    (``io.liveshard.v1alpha1.ElasticTrainingJob``), built-in kinds by their Go package."""
    if custom:
        return ".".join([*reversed(group.split(".")), version, kind])
    if group == "apiextensions.k8s.io":
        return f"io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.{version}.{kind}"
    if group == "apiregistration.k8s.io":
        return f"io.k8s.kube-aggregator.pkg.apis.apiregistration.{version}.{kind}"
    return f"io.k8s.api.{group.split('.')[0] if group else 'core'}.{version}.{kind}"


def _operation_id(verb: str, group: str, version: str, kind: str, namespaced: bool, suffix: str = "") -> str:
    gv = "".join(p[:1].upper() + p[1:] for p in re.split(r"[.\-]", group) if p) or "Core"
    return f"{verb}{gv}{version[:1].upper()}{version[1:]}{'Namespaced' if namespaced else ''}{kind}{suffix}"


def _content(schema: dict[str, Any], types: Iterable[str] = _RESPONSE_TYPES) -> dict[str, Any]:
    return {t: {"schema": schema} for t in types}


def _resource_paths(group: str, version: str, plural: str, kind: str, namespaced: bool, verbs: set[str],
                    subresources: set[str], custom: bool) -> dict[str, Any]:
    """The paths of one resource, with their operations, as the API server publishes them."""
    prefix = "/" + _openapi_key(group, version)
    gvk = {"group": group, "version": version, "kind": kind}
    obj, listed = _ref(_schema_name(group, version, kind, custom)), _ref(_schema_name(group, version, kind + "List",
                                                                                      custom))
    patch_types = _PATCH_TYPES_CUSTOM if custom else _PATCH_TYPES_BUILTIN

    def op(action: str, verb: str, summary: str, schema: dict[str, Any], codes: Iterable[str], params: list[Any],
           body: dict[str, Any] | None = None, kind_gvk: dict[str, str] = gvk, suffix: str = "",
           in_namespace: bool = namespaced) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tags": [_openapi_key(group, version).replace("/", "_")], "description": summary,
            "operationId": _operation_id(verb, group, version, kind_gvk["kind"] if suffix else kind,
                                         in_namespace, suffix),
            "parameters": params,
            "responses": {code: {"description": {"200": "OK", "201": "Created", "202": "Accepted"}[code],
                                 "content": _content(schema)} for code in codes},
            "x-kubernetes-action": action, "x-kubernetes-group-version-kind": dict(kind_gvk)}
        if body is not None:
            out["requestBody"] = body
        return out

    def whole(schema: dict[str, Any]) -> dict[str, Any]:
        return {"content": {"*/*": {"schema": schema}}, "required": True}

    patch_body = {"content": {t: {"schema": _ref(f"{_META}.Patch")} for t in patch_types}, "required": True}
    write = [_Q_DRY_RUN, _Q_FIELD_MANAGER, _Q_FIELD_VALIDATION]
    scope_params = [_PATH_PARAMS["namespace"]] if namespaced else []
    collection = f"{prefix}/namespaces/{{namespace}}/{plural}" if namespaced else f"{prefix}/{plural}"
    item = f"{collection}/{{name}}"
    paths: dict[str, Any] = {}
    coll: dict[str, Any] = {"parameters": [*scope_params, _Q_PRETTY]}
    if "list" in verbs:
        coll["get"] = op("list", "list", f"list or watch objects of kind {kind}", listed, ["200"], _LIST_PARAMS)
        if namespaced:  # and across namespaces
            paths[f"{prefix}/{plural}"] = {"parameters": [_Q_PRETTY], "get": op(
                "list", "list", f"list or watch objects of kind {kind}", listed, ["200"], _LIST_PARAMS,
                suffix="ForAllNamespaces", in_namespace=False)}
    if "create" in verbs:
        coll["post"] = op("post", "create", f"create a {kind}", obj, ["200", "201", "202"], write, whole(obj))
    if len(coll) > 1:
        paths[collection] = coll
    named: dict[str, Any] = {"parameters": [_PATH_PARAMS["name"], *scope_params, _Q_PRETTY]}
    if "get" in verbs:
        named["get"] = op("get", "read", f"read the specified {kind}", obj, ["200"], [])
    if "update" in verbs:
        named["put"] = op("put", "replace", f"replace the specified {kind}", obj, ["200", "201"], write, whole(obj))
    if "patch" in verbs:
        named["patch"] = op("patch", "patch", f"partially update the specified {kind}", obj, ["200", "201"],
                            [*write, _Q_FORCE], patch_body)
    if "delete" in verbs:
        named["delete"] = op("delete", "delete", f"delete a {kind}", _ref(f"{_META}.Status"), ["200", "202"],
                             [_Q_GRACE], whole(_ref(f"{_META}.DeleteOptions")))
    if len(named) > 1:
        paths[item] = named
    sub_params = [_PATH_PARAMS["name"], *scope_params, _Q_PRETTY]
    if "status" in subresources:
        paths[f"{item}/status"] = {
            "parameters": sub_params,
            "get": op("get", "read", f"read status of the specified {kind}", obj, ["200"], [], suffix="Status"),
            "put": op("put", "replace", f"replace status of the specified {kind}", obj, ["200", "201"], write,
                      whole(obj), suffix="Status"),
            "patch": op("patch", "patch", f"partially update status of the specified {kind}", obj, ["200", "201"],
                        [*write, _Q_FORCE], patch_body, suffix="Status")}
    if "scale" in subresources:
        scale, scale_gvk = _ref("io.k8s.api.autoscaling.v1.Scale"), {"group": "autoscaling", "version": "v1",
                                                                     "kind": "Scale"}
        paths[f"{item}/scale"] = {
            "parameters": sub_params,
            "get": op("get", "read", f"read scale of the specified {kind}", scale, ["200"], [], kind_gvk=scale_gvk,
                      suffix="Scale"),
            "put": op("put", "replace", f"replace scale of the specified {kind}", scale, ["200", "201"], write,
                      whole(scale), kind_gvk=scale_gvk, suffix="Scale"),
            "patch": op("patch", "patch", f"partially update scale of the specified {kind}", scale, ["200", "201"],
                        [*write, _Q_FORCE], patch_body, kind_gvk=scale_gvk, suffix="Scale")}
    if not group and plural == "pods":
        paths[f"{item}/log"] = {"parameters": sub_params, "get": {
            "tags": ["core_v1"], "description": "read log of the specified Pod", "operationId": "readCoreV1NamespacedPodLog",
            "parameters": [_query(p, f"the log's {p}") for p in ("container", "follow", "previous", "tailLines",
                                                                   "limitBytes")],
            "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}},
            "x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk}}
        binding = {"group": "", "version": "v1", "kind": "Binding"}
        paths[f"{item}/binding"] = {"parameters": sub_params, "post": op(
            "post", "create", "create binding of a Pod", _ref("io.k8s.api.core.v1.Binding"), ["200", "201", "202"],
            write, whole(_ref("io.k8s.api.core.v1.Binding")), kind_gvk=binding, suffix="Binding")}
    return paths


def _crd_schemas(crd: dict[str, Any], version: dict[str, Any]) -> dict[str, Any]:
    """The components/schemas of one served version of a CRD: the kind (its openAPIV3Schema, with
    ``metadata`` as ObjectMeta) and its list."""
    spec = crd["spec"]
    group, kind, name = spec["group"], spec["names"]["kind"], version["name"]
    schema = copy.deepcopy(((version.get("schema") or {}).get("openAPIV3Schema")) or {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True})
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string", "description": "APIVersion defines the versioned schema of this "
                           "representation of an object."}
    props["kind"] = {"type": "string", "description": "Kind is a string value representing the REST resource this "
                     "object represents."}
    props["metadata"] = {"allOf": [_ref(f"{_META}.ObjectMeta")], "description": "Standard object's metadata."}
    schema["type"] = "object"
    schema["x-kubernetes-group-version-kind"] = [{"group": group, "kind": kind, "version": name}]
    listed = {"type": "object", "required": ["items"], "description": f"{kind}List is a list of {kind}",
              "properties": {"apiVersion": props["apiVersion"], "kind": props["kind"],
                             "items": {"type": "array", "items": _ref(_schema_name(group, name, kind, True))},
                             "metadata": {"allOf": [_ref(f"{_META}.ListMeta")], "description": "Standard list "
                                          "metadata."}},
              "x-kubernetes-group-version-kind": [{"group": group, "kind": f"{kind}List", "version": name}]}
    return {_schema_name(group, name, kind, True): schema, _schema_name(group, name, f"{kind}List", True): listed}


def _builtin_schema(group: str, version: str, kind: str) -> dict[str, Any]:
    # a stand-in without x-kubernetes-group-version-kind: kubectl finds no schema for the kind and
    # uses its own (compiled-in) types for strategic merge patches
    return {"type": "object", "description": f"{kind} ({_openapi_key(group, version)}).",
            "x-kubernetes-preserve-unknown-fields": True}


class KubeEmulator:
    """The emulator served on a free loopback port from a background thread."""

    def __init__(self, crds: Iterable[str | Path | dict[str, Any]] = (), host: str = "127.0.0.1") -> None:
        self.host = host
        self.emulator = Emulator()
        self.emulator.resources.load_bundled()
        for crd in crds:
            self.register_crd(crd)
        self.url = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def register_crd(self, crd: str | Path | dict[str, Any]) -> None:
        if not isinstance(crd, dict):
            crd = yaml.safe_load(Path(crd).read_text())
        self.emulator.register_crd(crd)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> KubeEmulator:
        self._thread = threading.Thread(target=self._serve, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the Kubernetes emulator did not start")
        if self._error is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        # one access-log line per request (the operator and the node agent poll): too much
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator, host=self.host) as server:
            self.url = f"http://{server.host}:{server.port}"
            self._ready.set()
            await self._stop.wait()

    # ---- clients ----------------------------------------------------------------------------
    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator",
                                                          "namespace": namespace}}],
        }

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig(namespace)))
        return path

    def api_client(self) -> Any:
        import kubernetes.client

        config = kubernetes.client.Configuration()
        config.host = self.url
        return kubernetes.client.ApiClient(config)


def run_pod(core: Any, namespace: str, name: str, node: str, phase: str = "Running") -> None:
    """Stand in for the scheduler and the kubelet: bind a pod to a node and set its phase.

    ``core`` is a ``kubernetes.client.CoreV1Api``. The pod is bound as a scheduler binds it,
    through the ``binding`` subresource (its spec is immutable). The client cannot read the
    ``Status`` the server answers as a ``V1Binding``: ``_preload_content=False`` skips that.
    """
    core.create_namespaced_pod_binding(name, namespace, {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, _preload_content=False)
    core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": phase}})


def finish_terminating_pods(core: Any, namespace: str) -> list[str]:
    """Stand in for the kubelets: a pod being deleted gracefully is gone once its kubelet has
    stopped its containers and deleted it again with grace 0 (bound to the pod's uid, so that a
    new pod of the same name is never hit). Returns the pods finished."""
    from kubernetes.client.rest import ApiException

    done = []
    for pod in core.list_namespaced_pod(namespace).items:
        if pod.metadata.deletion_timestamp is None:
            continue
        try:
            core.delete_namespaced_pod(pod.metadata.name, namespace, body={
                "gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}})
            done.append(pod.metadata.name)
        except ApiException as e:
            if e.status not in (404, 409):  # gone already, or a new pod of that name
                raise
    return done


__all__ = ["Emulator", "KubeEmulator", "finish_terminating_pods", "run_pod"]
