"""Leader election over a coordination.k8s.io/v1 Lease, against the API emulator (which answers a
stale resourceVersion with 409 Conflict, as kube-apiserver does).

First the elector alone (who wins, when a lease may be taken over, that a leader stops before
another starts), then two real operators: only the one holding the Lease reconciles, the other
takes over when it stops, and one that loses the Lease stops acting.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import kubernetes.client as k8s
import pytest
from test_operator_emulator import NS, Cluster, wait_for

from liveshard.dev.ports import free_port
from liveshard.operator.command import EXIT_LEADERSHIP_LOST, run_operator
from liveshard.operator.kube import Kube, NotLeader
from liveshard.operator.leader import LeaderElector, LeaseStore
from liveshard.operator.options import LeaderElection, Options
from liveshard.runtime.contract.times import iso

# short timings: a takeover within seconds (the defaults are 15 s / 10 s / 2 s)
DURATION, RENEW, RETRY = 2.0, 1.0, 0.1
LEASE = "liveshard-operator"


def config(identity: str, name: str = LEASE) -> LeaderElection:
    return LeaderElection(namespace=NS, name=name, identity=identity, lease_duration=DURATION,
                          renew_deadline=RENEW, retry_period=RETRY)


def elector(kube, identity: str, name: str = LEASE) -> LeaderElector:
    return LeaderElector(LeaseStore(kube.api_client(), NS, name, timeout=RENEW), config(identity, name))


def read_lease(kube, name: str = LEASE) -> dict:
    api = k8s.CoordinationV1Api(kube.api_client())
    return json.loads(api.read_namespaced_lease(name, NS, _preload_content=False).data)


def hijack(kube, name: str = LEASE, holder: str = "intruder") -> None:
    """Another process takes the Lease over (as after a network partition): a fresh renewal."""
    api = k8s.CoordinationV1Api(kube.api_client())
    for _ in range(20):  # the holder may renew between our read and our write: read again (409)
        lease = read_lease(kube, name)
        lease["spec"].update(holderIdentity=holder, renewTime=iso(time.time()), leaseDurationSeconds=60)
        try:
            api.replace_namespaced_lease(name, NS, lease, _preload_content=False)
            return
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError(f"could not take over the lease {name}: every write conflicted")


# ---- the elector ------------------------------------------------------------------------------
def test_of_two_candidates_one_holds_the_lease(kube):
    async def main():
        a, b = elector(kube, "a", "l1"), elector(kube, "b", "l1")
        assert await a.try_acquire_or_renew() and a.is_leader
        assert not await b.try_acquire_or_renew() and not b.is_leader and b.holder == "a"
        await asyncio.sleep(0.3)
        assert await a.try_acquire_or_renew()  # the holder renews
        assert not await b.try_acquire_or_renew()

    asyncio.run(main())
    spec = read_lease(kube, "l1")["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 2 and spec["leaseTransitions"] == 0
    assert spec["renewTime"] and spec["acquireTime"]


def test_lease_times_are_written_as_kube_apiserver_parses_them():
    """MicroTime: RFC 3339 with exactly six fractional digits, even when they are zero (the
    client's own models would drop them, and a real API server refuses the Lease)."""
    from datetime import UTC, datetime

    at = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    a = LeaderElector(None, config("a"), wall=lambda: at)
    spec = a._record(None)["spec"]
    assert spec["renewTime"] == spec["acquireTime"] == "2026-03-01T12:00:00.000000Z"
    assert spec["leaseDurationSeconds"] == 2 and isinstance(spec["leaseDurationSeconds"], int)
    # a fractional duration is rounded up: others never wait less than the leader's deadline assumes
    b = LeaderElector(None, LeaderElection(namespace=NS, identity="b", lease_duration=2.5, renew_deadline=2,
                                           retry_period=1))
    assert b._record(None)["spec"]["leaseDurationSeconds"] == 3


def test_racing_candidates_never_both_win(kube):
    """Both read the same free Lease and write it: the resourceVersion makes one of them lose."""
    async def main():
        wins = []
        for round_ in range(5):
            name = f"race-{round_}"
            a, b = elector(kube, "a", name), elector(kube, "b", name)
            assert await a.try_acquire_or_renew()
            await a.release()  # free, with a resourceVersion both will read
            results = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
            wins.append(sum(results))
            assert read_lease(kube, name)["spec"]["holderIdentity"] == ("a" if results[0] else "b")
        return wins

    assert asyncio.run(main()) == [1] * 5


def test_a_lease_not_renewed_is_taken_over_after_the_lease_duration_and_not_before(kube):
    async def main():
        a, b = elector(kube, "a", "l2"), elector(kube, "b", "l2")
        assert await a.try_acquire_or_renew()
        started = time.monotonic()
        # a stops renewing (it hangs or dies without releasing); b keeps trying
        stop = asyncio.Event()
        acquired = await asyncio.wait_for(b.acquire(stop), timeout=10)
        waited = time.monotonic() - started
        return acquired, waited, a.is_leader

    acquired, waited, a_still_leader = asyncio.run(main())
    assert acquired and DURATION <= waited < DURATION + 1.5
    assert not a_still_leader  # a had stopped counting itself leader before b took over
    spec = read_lease(kube, "l2")["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


def test_a_clean_release_hands_over_at_once(kube):
    async def main():
        a, b = elector(kube, "a", "l3"), elector(kube, "b", "l3")
        assert await a.try_acquire_or_renew()
        stop = asyncio.Event()
        waiting = asyncio.create_task(b.acquire(stop))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        released = time.monotonic()
        await a.release()
        assert not a.is_leader
        await asyncio.wait_for(waiting, timeout=5)
        return time.monotonic() - released

    assert asyncio.run(main()) < DURATION / 2


def test_a_leader_that_cannot_renew_stops_within_the_renew_deadline(kube):
    async def main():
        a = elector(kube, "a", "l4")
        assert await a.try_acquire_or_renew()
        stop = asyncio.Event()
        keeping = asyncio.create_task(a.keep(stop))
        await asyncio.sleep(0.5)
        assert a.is_leader and not stop.is_set()  # renewing
        taken = time.monotonic()
        await asyncio.to_thread(hijack, kube, "l4")
        await asyncio.wait_for(stop.wait(), timeout=5)
        await keeping
        return time.monotonic() - taken, a

    stopped_after, a = asyncio.run(main())
    assert a.lost and not a.is_leader and stopped_after <= RENEW + 2 * RETRY + 0.5


def test_timings_that_could_give_two_leaders_are_refused():
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElector(None, LeaderElection(namespace=NS, lease_duration=10, renew_deadline=10, retry_period=2))


def test_writes_are_fenced_once_the_lease_is_not_held():
    kube = Kube(k8s.ApiClient(k8s.Configuration()), workers=1)  # no server: a fenced write never gets there
    kube.fence = lambda: False
    try:
        for write in (kube.create({"kind": "Pod", "metadata": {"name": "p", "namespace": NS}}),
                      kube.delete_pod(NS, "p"), kube.patch_job_status(NS, "j", {"phase": "Running"}, "1")):
            with pytest.raises(NotLeader):
                asyncio.run(write)
    finally:
        kube.close()


# ---- two operators ----------------------------------------------------------------------------
class Replica:
    """``liveshard operator`` with leader election, in a thread; keeps its exit code."""

    def __init__(self, url: str, identity: str) -> None:
        self.health_port = free_port()
        self.options = Options(server=url, metrics_port=None, liveness=f"http://127.0.0.1:{self.health_port}/healthz",
                               leader_election=config(identity))
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"operator-{identity}", daemon=True)

    def _run(self) -> None:
        self.exit_code = run_operator(self.options, self.stop_flag, self.ready_flag)

    def start(self) -> Replica:
        self.thread.start()
        return self

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the operator did not stop"


def test_only_the_leader_reconciles_and_the_standby_takes_over(kube):
    cluster = Cluster(kube)
    a = Replica(kube.url, "op-a").start()
    assert a.ready_flag.wait(30), "the first replica did not start"
    b = Replica(kube.url, "op-b").start()
    try:
        assert wait_for(lambda: _answers(b), what="the standby's liveness endpoint") == {"leader": False}
        cluster.create_job("india", {"min": 1, "max": 2, "gpusPerWorker": 1})
        wait_for(lambda: len(cluster.workers("india")) == 2, what="worker pods from the leader")
        assert read_lease(kube)["spec"]["holderIdentity"] == "op-a"
        time.sleep(DURATION + 0.5)  # longer than a lease: the leader renews, the standby waits
        assert read_lease(kube)["spec"]["holderIdentity"] == "op-a"
        assert not b.ready_flag.is_set(), "the standby started kopf while the leader holds the lease"

        stopped = time.monotonic()
        a.stop()
        assert a.exit_code == 0
        assert b.ready_flag.wait(DURATION + 5), "the standby did not take over"
        assert time.monotonic() - stopped < DURATION + 5
        assert read_lease(kube)["spec"]["holderIdentity"] == "op-b"
        # the new leader acts: a deleted worker pod is created again
        uid = cluster.workers("india")["india-worker-1"].metadata.uid
        cluster.core.delete_namespaced_pod("india-worker-1", NS)
        wait_for(lambda: (p := cluster.workers("india").get("india-worker-1")) is not None and p.metadata.uid != uid,
                 what="the pod re-created by the new leader")

        # it loses the lease (another holder renews it): it stops acting and exits non-zero
        hijack(kube)
        b.thread.join(RENEW + 15)
        assert not b.thread.is_alive(), "the replica that lost the lease kept running"
        assert b.exit_code == EXIT_LEADERSHIP_LOST
        assert read_lease(kube)["spec"]["holderIdentity"] == "intruder"  # and it did not release it
    finally:
        for replica in (a, b):
            if replica.thread.is_alive():
                replica.stop()


def _answers(replica: Replica) -> dict | None:
    try:
        return replica.health()
    except OSError:
        return None
