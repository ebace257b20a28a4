"""The job's store accepts only values made with the job's secret, and a reader that finds a value
forged, replayed or deleted keeps the last valid one and counts it (no processes).

Most tests run over a real c10d ``TCPStore`` on 127.0.0.1: the server, one client per job
process (a ``JobStore`` with the secret) and one raw client as the attacker, who has the port
but not the secret and uses the store's own operations (set, get, compare_set, delete_key, add).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from liveshard.runtime.contract.keys import COMMITTED, SECRET_ENV, Keys
from liveshard.runtime.control.metrics import JobMetrics
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.store import JobStore, Seen, StoreRead, connect_store, job_secret, serve_store
from liveshard.runtime.errors import ConfigError

SECRET = b"s3cret"


class Synced:
    """The attacker's client, each write followed by a round trip on the same connection: a c10d
    ``set`` is not acknowledged, so without it a job's read on its own connection can overtake it."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def __getattr__(self, name: str):
        op = getattr(self._store, name)
        if name not in ("set", "compare_set", "delete_key", "add"):
            return op

        def synced(*args, **kwargs):
            result = op(*args, **kwargs)
            self._store.num_keys()
            return result

        return synced


@dataclass
class Net:
    """One job's view of the store: ``job()`` is a process of the job (its own ``JobStore``, so its
    own memory of what it accepted), ``attacker`` a bare client that addresses the job's keys."""

    client: dist.TCPStore
    attacker: Synced
    name: str

    def job(self, secret: bytes | None = SECRET, **kw) -> JobStore:
        return JobStore(self.client, self.name, secret, **kw)


@pytest.fixture(scope="module")
def tcp() -> Iterator[tuple[dist.TCPStore, dist.TCPStore, dist.TCPStore]]:
    # One server and two client connections for the module (each test has a job of its own):
    # connecting is the slow, occasionally stalling part of a TCPStore on a loaded machine.
    server = serve_store("127.0.0.1", 0)
    yield server, connect_store("127.0.0.1", server.port), connect_store("127.0.0.1", server.port)


@pytest.fixture
def net(tcp, request) -> Net:
    _, client, attacker = tcp
    name = request.node.name.replace("[", "-").replace("]", "")
    return Net(client, Synced(dist.PrefixStore(f"liveshard/{name}/", attacker)), name)


def test_a_forged_heartbeat_keeps_the_last_valid_one_is_put_back_and_counted_once_per_value(net, caplog):
    """A reader puts the last valid beat back over a forged one: tampering shows only while it
    is done again (an attacker that stops leaves silence, not a key forged for ever)."""
    worker, coordinator, attacker = net.job(), net.job(), net.attacker
    worker.set_json(Keys.heartbeat("w0"), {"time": 1.0, "state": "training"})
    assert coordinator.read(Keys.heartbeat("w0")).seen is Seen.VALID
    caplog.set_level(logging.WARNING, logger="liveshard.store")
    for i in range(3):  # garbage every few ms; the coordinator reads each twice
        attacker.set(Keys.heartbeat("w0"), f"garbage {i}")
        first, second = coordinator.read(Keys.heartbeat("w0")), coordinator.read(Keys.heartbeat("w0"))
        assert first.seen is Seen.FORGED and json.loads(first.value)["time"] == 1.0
        assert second.seen is Seen.VALID and json.loads(second.value)["time"] == 1.0  # put back
    assert coordinator.get_json(Keys.heartbeat("w0"))["time"] == 1.0
    assert coordinator.tampering[Seen.FORGED] == 3  # three bad values
    assert coordinator.tampered_keys() == {Keys.heartbeat("w0"): frozenset({Seen.FORGED})}
    assert len([r for r in caplog.records if "hb/w0" in r.getMessage()]) == 1  # logged once
    worker.set_json(Keys.heartbeat("w0"), {"time": 2.0, "state": "training"})  # the next valid beat
    assert coordinator.read(Keys.heartbeat("w0")).seen is Seen.VALID
    assert coordinator.get_json(Keys.heartbeat("w0"))["time"] == 2.0
    attacker.set(Keys.heartbeat("w9"), "garbage")  # a key never validly written: a tombstone over it
    assert coordinator.read(Keys.heartbeat("w9")).seen is Seen.FORGED
    assert coordinator.read(Keys.heartbeat("w9")) == StoreRead(None, Seen.VALID)


def test_a_key_never_validly_written_reads_as_absent_or_forged_never_a_value(net):
    job, attacker = net.job(), net.attacker
    assert job.read(Keys.STOP) == job.read(Keys.STOP) and job.read(Keys.STOP).seen is Seen.ABSENT
    attacker.set(Keys.STOP, "1")
    r = job.read(Keys.STOP)
    assert (r.value, r.seen) == (None, Seen.FORGED) and not job.has(Keys.STOP)


def test_a_replayed_older_checkpoint_record_does_not_replace_the_newer(net):
    rank0, coordinator, attacker = net.job(), net.job(), net.attacker
    rank0.publish_checkpoint({"path": "/c/step10", "step": 10})
    old = attacker.get(Keys.CHECKPOINT)  # validly sealed, captured by the attacker
    assert coordinator.get_json(Keys.CHECKPOINT)["step"] == 10
    rank0.publish_checkpoint({"path": "/c/step20", "step": 20})
    assert coordinator.get_json(Keys.CHECKPOINT)["step"] == 20
    attacker.set(Keys.CHECKPOINT, old)  # written back after step 10 was pruned
    r = coordinator.read(Keys.CHECKPOINT)
    assert r.seen is Seen.REPLAYED and json.loads(r.value)["step"] == 20
    assert coordinator.tampering[Seen.REPLAYED] == 1


def test_a_lower_checkpoint_step_is_refused_unless_it_is_a_rewind(net):
    rank0, coordinator, other = net.job(), net.job(), net.job()
    rank0.publish_checkpoint({"path": "/c/step20", "step": 20})
    assert coordinator.get_json(Keys.CHECKPOINT)["step"] == 20
    # a newer sequence but a lower step, written as an ordinary value: refused by the value order
    other.set_json(Keys.CHECKPOINT, {"path": "/c/step5", "step": 5})
    assert coordinator.read(Keys.CHECKPOINT).seen is Seen.REPLAYED
    assert coordinator.get_json(Keys.CHECKPOINT)["step"] == 20
    # the job restored step 5 and saved step 8: rank 0, which published step 20, publishes this
    # one as a rewind, and it stands
    rank0.publish_checkpoint({"path": "/c/step8", "step": 8})
    r = coordinator.read(Keys.CHECKPOINT)
    assert r.seen is Seen.VALID and json.loads(r.value)["step"] == 8


def test_a_forged_precreated_decision_does_not_block_decide(net):
    member, coordinator, attacker = net.job(), net.job(), net.attacker
    key = Keys.decision(3)
    attacker.set(key, "aborted: forged")
    assert member.decide(key, COMMITTED) == COMMITTED  # the first valid writer wins
    assert member.tampering[Seen.FORGED] == 1
    assert coordinator.decide(key, "aborted: too late") == COMMITTED  # a valid value is there
    assert coordinator.read(key) == member.read(key)
    assert coordinator.read(key).seen is Seen.VALID


def test_decide_against_a_planted_old_format_or_empty_value(net):
    member, attacker = net.job(), net.attacker
    attacker.set(Keys.decision(4), "")
    assert member.decide(Keys.decision(4), COMMITTED) == COMMITTED
    sealed = attacker.get(Keys.decision(4)).decode()
    attacker.set(Keys.decision(5), sealed)  # a valid seal, but of another key
    assert member.decide(Keys.decision(5), "aborted: x") == "aborted: x"


def test_a_forged_value_under_a_decided_key_does_not_change_the_answer_and_is_put_back(net):
    member, coordinator, attacker = net.job(), net.job(), net.attacker
    key = Keys.decision(7)
    assert member.decide(key, COMMITTED) == COMMITTED
    assert coordinator.get(key) == COMMITTED
    original = attacker.get(key)
    attacker.set(key, "aborted: forged")
    r = coordinator.read(key)
    assert (r.value, r.seen) == (COMMITTED, Seen.FORGED)
    assert attacker.get(key) == original  # the reader put the decision back for the next one
    assert net.job().get(key) == COMMITTED  # a reader that never saw it before


def test_deleting_a_decision_that_was_read_keeps_the_answer_and_counts_it(net):
    member, coordinator, attacker = net.job(), net.job(), net.attacker
    key = Keys.decision(9)
    member.decide(key, COMMITTED)
    assert coordinator.get(key) == COMMITTED
    attacker.delete_key(key)
    r = coordinator.read(key)
    assert (r.value, r.seen) == (COMMITTED, Seen.DELETED) and coordinator.get(key) == COMMITTED
    assert coordinator.tampering[Seen.DELETED] == 1
    # put back, so a late member's decide cannot write a second, different decision
    assert net.job().decide(key, "aborted: no decision in 60 s") == COMMITTED


def test_a_reader_that_decides_after_a_deletion_keeps_its_decision_and_puts_it_back(net):
    member, coordinator, attacker = net.job(), net.job(), net.attacker
    key = Keys.decision(10)
    member.decide(key, COMMITTED)
    assert coordinator.get(key) == COMMITTED
    attacker.delete_key(key)
    assert coordinator.decide(key, "aborted: member w1 died") == COMMITTED
    assert net.job().get(key) == COMMITTED and coordinator.tampering[Seen.DELETED] == 1


def test_a_second_valid_decision_after_a_deletion_does_not_change_a_readers_answer(net):
    first, second, coordinator, attacker = net.job(), net.job(), net.job(), net.attacker
    key = Keys.decision(11)
    first.decide(key, COMMITTED)
    assert coordinator.get(key) == COMMITTED
    attacker.delete_key(key)
    assert second.decide(key, "aborted: late") == "aborted: late"  # never read the first one
    r = coordinator.read(key)
    assert (r.value, r.seen) == (COMMITTED, Seen.REPLAYED)  # write-once: the first accepted stands


def test_a_protocol_delete_is_absent_not_tampering(net):
    a, b = net.job(), net.job()
    a.set(Keys.STOP, "1")
    assert b.get(Keys.STOP) == "1"
    a.delete(Keys.STOP)
    r = b.read(Keys.STOP)
    assert (r.value, r.seen) == (None, Seen.ABSENT) and not b.tampering


def test_an_old_format_value_is_refused(net):
    job, attacker = net.job(), net.attacker
    import hashlib
    import hmac

    key = Keys.switch(3)
    old = hmac.new(SECRET, f"{key}\0{17}".encode(), hashlib.sha256).hexdigest()  # the v1 seal, secret and all
    attacker.set(key, f"{old}.17")
    assert job.read(key) == job.read(key) and job.read(key).seen is Seen.FORGED and job.get(key) is None


@pytest.mark.parametrize("garbage", [b"\xff\xfe", "v2.1.s.\u00e9.x".encode(), "v2.\u00b2.s.ab.x".encode(),
                                     b"v2." + b"9" * 5000 + b".s.ab.x", b"", b"\0liveshard-probe-not"])
def test_any_bytes_an_attacker_writes_are_forged_never_an_error(net, garbage):
    job, attacker = net.job(), net.attacker
    attacker.set(Keys.decision(1), garbage)
    assert job.read(Keys.decision(1)).seen is Seen.FORGED
    assert job.decide(Keys.decision(1), COMMITTED) == COMMITTED


def test_a_value_is_bound_to_the_jobs_incarnation(net):
    earlier = net.job(incarnation="uid-1")
    earlier.set(Keys.STOP, "1")
    now = net.job(incarnation="uid-2")  # same name, same secret, a new job object
    assert now.read(Keys.STOP).seen is Seen.FORGED


def test_a_writer_whose_clock_is_behind_is_accepted(net):
    now = 1_700_000_000 * 10**9
    ahead = net.job(clock=lambda: now)
    behind = net.job(clock=lambda: now - 60 * 10**9)  # a restarted worker on a node a minute behind
    reader = net.job()
    ahead.set_json(Keys.heartbeat("w0"), {"time": 1.0})
    assert reader.get_json(Keys.heartbeat("w0"))["time"] == 1.0
    behind.set_json(Keys.heartbeat("w0"), {"time": 2.0})
    r = reader.read(Keys.heartbeat("w0"))
    assert r.seen is Seen.VALID and json.loads(r.value)["time"] == 2.0
    behind.set_json(Keys.heartbeat("w0"), {"time": 3.0})
    assert reader.get_json(Keys.heartbeat("w0"))["time"] == 3.0 and not reader.tampering


def test_a_bumped_counter_and_forged_slots_neither_hide_nor_block_members(net):
    job, coordinator, attacker = net.job(), net.job(), net.attacker
    attacker.add(Keys.MEMBER_COUNT, 10**9)  # the counter an earlier version scanned up to
    attacker.set(Keys.member_index(0), "evil")
    job.register_member("a", {"host": "h"})
    job.register_member("b", {"host": "h"})
    assert coordinator.members() == ["a", "b"]
    assert coordinator.entries(Keys.member_index) == [(0, "a"), (1, "b")]  # the planted slot taken over
    assert job.tampering[Seen.FORGED] == 1  # the writer saw it, and counted it


def test_thousands_of_forged_slots_cost_a_reader_and_a_writer_a_few_reads_and_log_one_summary(net, caplog,
                                                                                              monkeypatch):
    """Slots planted ahead of a list's writers are taken over (the list stays dense), and a
    reader stops a few slots past the last entry: bounded work whatever was planted; the
    tampering is logged in a bounded number of lines, then as a summary."""
    from liveshard.runtime.control import store as store_module

    job, coordinator, attacker = net.job(), net.job(), net.attacker
    planted = 5000
    attacker.multi_set([Keys.member_index(i) for i in range(planted)], ["evil"] * planted)
    attacker.multi_set([Keys.request(i) for i in range(planted)], ["evil"] * planted)
    attacker.num_keys()  # the writes have landed
    caplog.set_level(logging.WARNING, logger="liveshard.store")
    reads = []
    probe = JobStore._probe
    monkeypatch.setattr(JobStore, "_probe", lambda self, key: reads.append(key) or probe(self, key))
    job.register_member("a", {"host": "h"})
    job.append(Keys.request, "r1")
    assert coordinator.members() == ["a"] and coordinator.entries(Keys.request) == [(0, "r1")]
    assert len(reads) < 40, len(reads)
    for i in range(1, 1201):
        coordinator.read(Keys.member_index(i))  # a reader that walks the planted slots anyway
    later = store_module.time.monotonic() + store_module.SUMMARY_EVERY
    monkeypatch.setattr(store_module.time, "monotonic", lambda: later)
    coordinator.log_tampering()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= 2 * store_module.LOGGED_KEYS + 1, len(lines)
    # the 1,200 walked and the 4 request slots read past the entry
    assert "store: 1,204 forged values on 1,204 keys in the last 10 s" in lines[-1], lines[-1]


def test_the_coordinator_exports_tampering_by_kind(net):
    worker, coordinator, attacker = net.job(), net.job(), net.attacker
    worker.set(Keys.heartbeat("w0"), "{}")
    coordinator.get(Keys.heartbeat("w0"))
    attacker.set(Keys.heartbeat("w0"), "x")
    coordinator.get(Keys.heartbeat("w0"))
    attacker.delete_key(Keys.heartbeat("w0"))
    coordinator.get(Keys.heartbeat("w0"))
    metrics = JobMetrics("j")
    for _ in range(2):  # totals, not increments: observing twice counts once
        metrics.observe_store_tampering(coordinator.tampering_counts())
    text = metrics.exposition().decode()
    assert 'liveshard_store_tampering_total{job="j",kind="forged"} 1.0' in text
    assert 'liveshard_store_tampering_total{job="j",kind="deleted"} 1.0' in text
    assert 'liveshard_store_tampering_total{job="j",kind="replayed"} 0.0' in text


# ---- in-process (HashStore) ----------------------------------------------------------------------
def test_values_without_the_jobs_secret_read_as_absent():
    raw = dist.HashStore()
    job = JobStore(raw, "j", SECRET)
    job.publish_plan(WorldPlan(generation=0, config="tp=1,pp=1,dp=2", members=("a", "b")))
    assert job.plan(0).members == ("a", "b") and job.latest_generation() == 0
    attacker = JobStore(raw, "j")  # a bare client on the same port, no secret
    attacker.set(Keys.STOP, "1")
    attacker.set(Keys.plan(1), WorldPlan(generation=1, config="tp=1,pp=1,dp=3", members=("a", "b", "evil")).to_json())
    assert not JobStore(raw, "j", SECRET).has(Keys.STOP) and job.plan(1) is None
    attacker.set(Keys.LATEST, "1")
    assert job.latest_generation() == 0  # the last valid value stands
    assert JobStore(raw, "j", SECRET).latest_generation() == -1  # a reader with none: absent
    wrong = JobStore(raw, "j", b"guess")
    wrong.set_json(Keys.member("evil"), {"host": "x"})
    assert job.get_json(Keys.member("evil")) is None


def test_a_value_cannot_be_replayed_under_another_key_or_altered():
    raw = dist.HashStore()
    job = JobStore(raw, "j", SECRET)
    job.set(Keys.switch(3), "17")
    sealed = job.store.get(Keys.switch(3)).decode()  # job.store: the raw (prefixed) c10d store
    job.store.set(Keys.switch(4), sealed)  # the same bytes under another key
    assert job.get(Keys.switch(4)) is None and job.get(Keys.switch(3)) == "17"
    head, _, _ = sealed.rpartition(".")
    job.store.set(Keys.switch(3), f"{head}.18")
    r = job.read(Keys.switch(3))
    assert (r.value, r.seen) == ("17", Seen.FORGED)
    assert JobStore(raw, "j", SECRET).get(Keys.switch(3)) is None


def test_a_forged_plan_request_is_never_seen_by_the_coordinator():
    coordinator = pytest.importorskip("liveshard.runtime.coordinator")  # being rewritten into a package
    raw = dist.HashStore()
    job = JobStore(raw, "j", SECRET)
    forged = JobStore(raw, "j")
    coordinator.StorePlanSource.post(forged, coordinator.PlanRequest(members=("evil",), config="tp=1,pp=1,dp=1"))
    coordinator.StorePlanSource.post(job, coordinator.PlanRequest(members=("a",), config="tp=1,pp=1,dp=1"))
    source = coordinator.StorePlanSource(job)
    seen = [source.poll() for _ in range(3)]
    assert [r.members for r in seen if r is not None] == [("a",)]


def test_a_pod_the_operator_built_refuses_to_run_without_its_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("LIVESHARD_ROLE", "worker")
    with pytest.raises(ConfigError, match=SECRET_ENV):
        job_secret()
    monkeypatch.setenv(SECRET_ENV, "abc")
    assert job_secret() == b"abc"
    monkeypatch.delenv("LIVESHARD_ROLE")
    monkeypatch.delenv(SECRET_ENV)
    assert job_secret() is None  # a local tool without one: unauthenticated, as its own choice


def test_a_port_in_use_is_a_one_line_error_naming_the_port(tcp):
    server, _, _ = tcp
    with pytest.raises(ConfigError, match=r"--port: cannot listen on 127.0.0.1:\d+: address already in use"):
        serve_store("127.0.0.1", server.port)
