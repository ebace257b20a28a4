"""The operator's Kubernetes API calls: the official client, run off the event loop.

The kubernetes client is synchronous; every call goes through a small thread pool so kopf's
event loop never blocks. Errors a reconcile expects (already exists, already gone) are
answered here; a stale resourceVersion raises ``Conflict`` so the caller re-reads and retries.

Writes are fenced: with leader election on, ``fence`` says whether this replica still holds the
lease, and a write is refused (``NotLeader``) once it does not, so a replica that lost the lease
changes nothing while it shuts down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes.client as k8s
from kubernetes.client.rest import ApiException

from liveshard.operator import kueue
from liveshard.runtime.contract.crd import GROUP, LABEL_JOB, PLURAL, VERSION


class Conflict(Exception):
    """The object changed since it was read."""


class NotLeader(Exception):
    """This replica no longer holds the leader lease: it must not write."""


class Kube:
    def __init__(self, api: k8s.ApiClient, workers: int = 16) -> None:
        self.api = api
        self.fence: Callable[[], bool] | None = None  # None: the only replica, always allowed
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.rbac = k8s.RbacAuthorizationV1Api(api)
        self.net = k8s.NetworkingV1Api(api)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube")

    async def _call(self, fn, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def _check_fence(self) -> None:
        if self.fence is not None and not self.fence():
            raise NotLeader("this operator replica does not hold the leader lease")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the job ----------------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.custom.get_namespaced_custom_object,
                                    GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def patch_job_status(self, namespace: str, name: str, status: dict[str, Any],
                               resource_version: str | None) -> dict[str, Any]:
        self._check_fence()
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            return await self._call(self.custom.patch_namespaced_custom_object_status,
                                    GROUP, VERSION, namespace, PLURAL, name, body)
        except ApiException as e:
            if e.status == 409:
                raise Conflict(f"{namespace}/{name} changed while it was reconciled") from None
            raise

    # ---- children ---------------------------------------------------------------------------
    async def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; False if it already exists."""
        self._check_fence()
        ns = obj["metadata"]["namespace"]
        create = {
            "Pod": self.core.create_namespaced_pod,
            "Secret": self.core.create_namespaced_secret,
            "Service": self.core.create_namespaced_service,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "NetworkPolicy": self.net.create_namespaced_network_policy,
        }.get(obj["kind"])
        if create is None and obj["kind"] == "Workload":
            return await self.create_workload(obj)
        assert create is not None
        try:
            await self._call(create, ns, obj)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    # ---- Kueue (only for jobs behind a queue: a cluster without Kueue is never asked) -----------
    async def list_workloads(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The Workloads labelled as the job's (``liveshard.io/job``; ownership is checked by
        the caller)."""
        try:
            got = await self._call(self.custom.list_namespaced_custom_object, kueue.GROUP, kueue.VERSION,
                                   namespace, kueue.WORKLOADS, label_selector=f"{LABEL_JOB}={job}")
        except ApiException as e:
            if e.status == 404:  # Kueue is not installed
                return []
            raise
        return list(got.get("items") or [])

    async def get_cluster_object(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped Kueue object (a ResourceFlavor, a WorkloadPriorityClass)."""
        try:
            return await self._call(self.custom.get_cluster_custom_object, kueue.GROUP, kueue.VERSION, plural, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def create_workload(self, obj: dict[str, Any]) -> bool:
        self._check_fence()
        try:
            await self._call(self.custom.create_namespaced_custom_object, kueue.GROUP, kueue.VERSION,
                             obj["metadata"]["namespace"], kueue.WORKLOADS, obj)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    async def patch_workload(self, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        self._check_fence()
        fn = (self.custom.patch_namespaced_custom_object_status if status
              else self.custom.patch_namespaced_custom_object)
        try:
            await self._call(fn, kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, patch)
        except ApiException as e:
            if e.status != 404:
                raise

    async def patch_pod(self, namespace: str, name: str, patch: list[dict[str, Any]]) -> bool:
        """Apply a JSON patch to a pod; False if it is gone or the patch's test failed (the pod
        changed meanwhile: the next pass reads it again)."""
        self._check_fence()
        try:
            await self._call(self.core.patch_namespaced_pod, name, namespace, patch,
                             _content_type="application/json-patch+json")
            return True
        except ApiException as e:
            if e.status in (404, 422):
                return False
            raise

    async def delete_pod(self, namespace: str, name: str) -> bool:
        self._check_fence()
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise
