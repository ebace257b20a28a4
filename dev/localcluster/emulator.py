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
* discovery fixed for the core group (``groupVersion: v1``; subresources carry no short
  names, or kubectl warns on every call); ``/version`` is v1.36, the server the operator was
  checked against; lists carry ``kind``/``apiVersion``.

Namespaces are not objects here: ``/api/v1/namespaces`` lists ``default`` and every namespace
in use. Still missing (don't depend on it): paging (``limit`` returns everything),
``deletecollection``, the strategic merge of lists not in ``_MERGE_KEYS`` (e.g. ``finalizers``,
which a real server merges as a set), server-side apply, ``/openapi``
(``kubectl apply --validate=false``), and kubelet/scheduler behaviour (pods stay Pending until
a test binds them; ``node_agent.py`` plays both in the local cluster).

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
import copy
import datetime
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
_CUSTOM_PATCHES = ("application/json-patch+json", "application/merge-patch+json")
_TRUE = ("true", "1", "True")

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


def _error(status: int, reason: str, message: str, causes: list[str] | None = None) -> kmock.KubernetesError:
    details = {"causes": [{"message": c} for c in causes]} if causes else {}
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details)


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
            if "scale" in subresources:
                self.scale_paths[res] = version["subresources"]["scale"]
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
        return await super().__call__(raw_request)

    async def _namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        names = sorted({"default", *(ns for _, ns, _ in self._objects if ns)})
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": n, "uid": f"ns-{n}", "creationTimestamp": self._started}, "status": {"phase": "Active"}}
            for n in names]
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
            return aiohttp.web.json_response(body, status=200)
        if request.action in _ACTIONS and request.subresource in (None, "status"):
            async with self._lock:
                if request.action == kmock.action.CREATE:
                    body, status = await self._create(request), 201
                elif request.action == kmock.action.UPDATE:
                    body, status = await self._patch(request), 200
                else:
                    body, status = await self._delete(request), 200
            return aiohttp.web.json_response(body, status=status)
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
        validator = self.validators.get(request.resource)
        if validator is not None:
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
        old = self._existing(key)
        if request.resource in self.validators:
            content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            if content_type not in _CUSTOM_PATCHES and not isinstance(request.data, list):
                raise _error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                             f"accepted media types include: {', '.join(_CUSTOM_PATCHES)}, "
                             "application/apply-patch+yaml")
        new = self._apply_patch(old, request)
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
        return await self._replace(key, old, new)

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
        return await self._replace(key, old, new)

    @staticmethod
    def _check_pod_update(key: Any, old: dict[str, Any], new: dict[str, Any]) -> None:
        """A pod's spec is immutable but for images, activeDeadlineSeconds and added tolerations."""
        if key[0] != _PODS:
            return
        before, after = copy.deepcopy(old.get("spec") or {}), copy.deepcopy(new.get("spec") or {})
        for spec in (before, after):
            spec.pop("activeDeadlineSeconds", None)
            for field in ("containers", "initContainers"):
                for container in spec.get(field) or []:
                    container.pop("image", None)
        old_tolerations, new_tolerations = before.pop("tolerations", None) or [], after.pop("tolerations", None) or []
        if before != after or any(t not in new_tolerations for t in old_tolerations):
            raise _error(422, "Invalid", f'Pod "{key[2]}" is invalid: spec: Forbidden: {_POD_SPEC_FORBIDDEN}',
                         [f"spec: Forbidden: {_POD_SPEC_FORBIDDEN}"])

    async def _replace(self, key: Any, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
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
        new["metadata"]["resourceVersion"] = self._next_rv()
        if _removable(new):
            await self._remove(key, new, old)
            return new
        self._store(key, new)
        self._emit(resource, "MODIFIED", new, old)
        return new

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
