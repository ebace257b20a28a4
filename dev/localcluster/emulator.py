"""A small Kubernetes API for tests and the embedded demo: kmock's emulator, made API-server-like.

``kmock.KubernetesEmulator`` (0.8) stores objects and serves list/watch/get/create/patch/delete,
but gives objects no ``resourceVersion``/``uid`` and keeps no rules. ``Emulator`` adds what kopf
and the kubernetes client rely on, as kube-apiserver does it:

* metadata on create: ``uid``, ``resourceVersion``, ``creationTimestamp``, ``namespace``,
  ``generation``; ``generateName``; 201 with the object; 409 AlreadyExists;
* patches: JSON patch (a failed ``test`` op is 422) and merge patch (strategic merge is treated
  as merge: lists replace); a stale ``metadata.resourceVersion`` is 409 Conflict; no-op patches
  change nothing; ``generation`` bumps when ``spec`` changes;
* PUT (replace) of a named object, e.g. a ``coordination.k8s.io`` Lease: the body replaces the
  object; a stale ``resourceVersion`` is 409 Conflict, none is an unconditional update, a name
  that differs from the URL's is 400, a missing object 404;
* the ``status`` subresource: ``/status`` writes only status, the main endpoint ignores status;
* the ``scale`` subresource of a registered CRD (``kubectl scale``, HPA): GET/PATCH/PUT;
* finalizers and ``deletionTimestamp``; background garbage collection by ownerReferences;
* registered CRDs are enforced: defaults, ``openAPIV3Schema``, CEL rules (422 with the
  API server's style of message; crd_validation.py);
* discovery fixed for the core group (``groupVersion: v1``); lists carry ``kind``/``apiVersion``.

Namespaces are not objects here: ``/api/v1/namespaces`` lists ``default`` and every namespace
in use. Still missing (don't depend on it): label and field selectors (filter client-side), watch
resumption from a resourceVersion (every watch replays all objects), server-side timeouts,
kubelet/scheduler behaviour (pods stay Pending until a test patches them),
pods are removed at once on delete (no graceful termination).

``KubeEmulator`` runs it on a free loopback port in a background thread::

    with KubeEmulator(crds=["crds/elastictrainingjob.yaml"]) as kube:
        client = kube.api_client()            # kubernetes.client.ApiClient
        kube.write_kubeconfig(tmp / "kubeconfig")
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import itertools
import json
import logging
import secrets
import threading
import uuid
from collections.abc import Iterable
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


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the API server behaviour kopf and kubectl need (see module doc)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.validators: dict[Any, CRDValidator] = {}
        self.scale_paths: dict[Any, dict[str, str]] = {}
        self._rv = itertools.count(1)

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
            if "scale" in subresources:
                self.scale_paths[res] = version["subresources"]["scale"]

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

    # ---- request routing --------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock cannot parse the namespace collection's path (/api/v1/namespaces); kopf lists and
        # watches it when it runs for named namespaces.
        if raw_request.path.rstrip("/") == "/api/v1/namespaces" and raw_request.method == "GET":
            return await self._namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        names = sorted({"default", *(ns for _, ns, _ in self._objects if ns)})
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n, "uid": f"ns-{n}"},
                  "status": {"phase": "Active"}} for n in names]
        if raw_request.query.get("watch") not in ("true", "1"):
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": str(next(self._rv))},
                                              "items": items})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        await asyncio.Event().wait()  # namespaces never change here; the client ends the watch
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock matches each request against its reactions by scanning every request recorded so
        # far: keep only the latest few, or each request costs O(requests served).
        del self._requests[:-_KEEP_REQUESTS]
        for errors in self._errors:
            del errors[:-10]
        if request.resource is None:
            return await super()._handle(request)
        if request.subresource == "scale" and request.name:
            return aiohttp.web.json_response(await self._scale(request))
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
            return aiohttp.web.json_response(self._objects[key].raw)
        # Reads go straight to kmock's reactions: there must be no await between recording the
        # request and matching it (the list above is trimmed by concurrent requests).
        return await kmock.RawHandler._handle(self, request)

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
            raise _error(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
        if self._has_status(request.resource):
            obj.pop("status", None)  # status is written through /status only
        if request.resource.plural == "pods" and request.resource.group == "":
            obj.setdefault("status", {"phase": "Pending"})
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
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)),
                    creationTimestamp=_now(), generation=1)
        obj.setdefault("kind", self._kind(request.resource))
        obj.setdefault("apiVersion", "/".join(p for p in (request.resource.group, request.resource.version) if p))
        self._store(key, obj)
        await self._buses[request.resource].put({"type": "ADDED", "object": obj})
        return obj

    async def _patch(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        old = self._existing(key)
        new = self._apply_patch(old, request)
        if request.subresource == "status":
            new = {**old, "status": new.get("status")} if "status" in new else {
                k: v for k, v in old.items() if k != "status"}
            new["metadata"] = dict(old["metadata"], **{k: v for k, v in new["metadata"].items()
                                                       if k == "resourceVersion"})
        elif self._has_status(request.resource):
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
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

    async def _replace(self, key: Any, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        resource = key[0]
        meta = new.setdefault("metadata", {})
        sent_rv = meta.get("resourceVersion")
        if sent_rv is not None and sent_rv != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", f'Operation cannot be fulfilled on {resource.plural} "{key[2]}": '
                         "the object has been modified; please apply your changes to the latest version")
        for immutable in ("uid", "name", "namespace", "creationTimestamp", "generation", "resourceVersion"):
            if immutable in old["metadata"]:
                meta[immutable] = old["metadata"][immutable]
        if new.get("spec") != old.get("spec"):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        validator = self.validators.get(resource)
        if validator is not None and new != old:
            new = self._validated(validator, new, old)
        if new == old:
            return old  # a no-op patch changes nothing, not even the resourceVersion
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            await self._remove(key, new)
            return new
        self._store(key, new)
        await self._buses[resource].put({"type": "MODIFIED", "object": new})
        return new

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        old = self._existing(key)
        if old["metadata"].get("deletionTimestamp"):
            return old
        new = copy.deepcopy(old)
        new["metadata"]["deletionTimestamp"] = _now()
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        if new["metadata"].get("finalizers"):
            self._store(key, new)
            await self._buses[key[0]].put({"type": "MODIFIED", "object": new})
        else:
            await self._remove(key, new)
        return new

    async def _remove(self, key: Any, last: dict[str, Any]) -> None:
        self._objects[key].history.append(None)
        await self._buses[key[0]].put({"type": "DELETED", "object": last})
        await self._collect_dependents(last["metadata"].get("uid"))

    async def _collect_dependents(self, owner_uid: str | None) -> None:
        """Background cascading deletion: objects owned by a removed object go too."""
        if not owner_uid:
            return
        for key, obj in list(self._objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                dependent = copy.deepcopy(obj.raw)
                dependent["metadata"]["deletionTimestamp"] = _now()
                dependent["metadata"]["resourceVersion"] = str(next(self._rv))
                if dependent["metadata"].get("finalizers"):
                    self._store(key, dependent)
                    await self._buses[key[0]].put({"type": "MODIFIED", "object": dependent})
                else:
                    await self._remove(key, dependent)

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
        return dict(kmock_dicts.merge_patch_dict(copy.deepcopy(old), body))

    @staticmethod
    def _validated(validator: CRDValidator, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        try:
            return validator.validate(obj, old)
        except InvalidObject as e:
            raise _error(422, "Invalid", str(e), e.errors) from None

    # ---- discovery and lists ----------------------------------------------------------------
    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        kind = self._kind(request.resource)
        payload["kind"] = f"{kind}List" if kind else "List"
        payload["apiVersion"] = "/".join(p for p in (request.resource.group, request.resource.version) if p)
        payload["metadata"] = {"resourceVersion": str(next(self._rv))}
        return payload


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

    ``core`` is a ``kubernetes.client.CoreV1Api``. A real cluster binds through the ``binding``
    subresource; the emulator lets the pod's spec be patched instead.
    """
    core.patch_namespaced_pod(name, namespace, {"spec": {"nodeName": node}})
    core.patch_namespaced_pod_status(name, namespace, {"status": {"phase": phase}})


__all__ = ["Emulator", "KubeEmulator", "run_pod"]
