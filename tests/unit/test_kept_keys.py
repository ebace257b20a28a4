"""``coordinator.kept.KeptKeys``: what the coordinator wrote and must stay written comes back after
a client without the secret deletes it, and what it keeps stays bounded."""

from __future__ import annotations

import torch.distributed as dist

from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator.kept import KEEP_PLANS, RESTORE_EVERY, KeptKeys

SECRET = b"k" * 32


def _published(store: JobStore, kept: KeptKeys, gen: int) -> WorldPlan:
    plan = WorldPlan(generation=gen, config="tp=1,pp=1,dp=2", members=("w0", "w1"),
                     previous=gen - 1 if gen else None)
    store.publish_plan(plan)
    kept.written(Keys.plan(gen), plan.to_json())
    kept.written(Keys.LATEST, str(gen))
    return plan


def test_a_plan_deleted_before_its_members_read_it_is_written_again():
    raw = dist.HashStore()
    store, kept = JobStore(raw, "j", SECRET), KeptKeys(JobStore(raw, "j", SECRET))
    plan = _published(store, kept, 3)
    attacker = JobStore(raw, "j")  # the store's port, not the secret
    for key in (Keys.plan(3), Keys.LATEST):
        attacker.delete(key)
    worker = JobStore(raw, "j", SECRET)  # a member that never read them: absent
    assert worker.plan(3) is None and worker.latest_generation() == -1
    kept.restore((), now=0.0)
    assert worker.plan(3) == plan and worker.latest_generation() == 3
    # forged in place: written again at the next read-back, not before
    attacker.set(Keys.plan(3), "{}")
    kept.restore((), now=RESTORE_EVERY / 2)
    assert JobStore(raw, "j", SECRET).plan(3) is None
    kept.restore((), now=RESTORE_EVERY)
    assert JobStore(raw, "j", SECRET).plan(3) == plan


def test_only_the_newest_plans_are_kept_and_the_pointers_are_never_pruned_as_plans():
    raw = dist.HashStore()
    store, kept = JobStore(raw, "j", SECRET), KeptKeys(JobStore(raw, "j", SECRET))
    for gen in range(10):
        _published(store, kept, gen)
    kept.write(Keys.CURRENT, "8")
    plans = [k for k in kept._values if k.removeprefix("plan/").isdigit()]
    assert plans == [Keys.plan(g) for g in range(10 - KEEP_PLANS, 10)]
    assert kept._values[Keys.LATEST] == "9" and kept._values[Keys.CURRENT] == "8"


def test_a_workers_writes_for_an_undecided_generation_come_back_until_it_is_decided():
    from liveshard.runtime.agent.kept_writes import KEPT_CHECK, KeptWrites
    from liveshard.runtime.contract.keys import COMMITTED

    raw = dist.HashStore()
    worker, kept = JobStore(raw, "j", SECRET), KeptWrites()
    for key, value in ((Keys.result(4, "w0"), '{"ok": true}'), (Keys.prepared(4, "w0"), "digest")):
        worker.set(key, value)
        kept.keep(4, key, value)
    attacker = JobStore(raw, "j")
    attacker.delete(Keys.result(4, "w0"))
    attacker.set(Keys.prepared(4, "w0"), "forged")
    coordinator = JobStore(raw, "j", SECRET)  # never read them: gone
    assert coordinator.get(Keys.result(4, "w0")) is None and coordinator.get(Keys.prepared(4, "w0")) is None
    kept.restore(worker, now=0.0)
    assert coordinator.get(Keys.result(4, "w0")) == '{"ok": true}'
    assert coordinator.get(Keys.prepared(4, "w0")) == "digest"
    # decided: dropped, not written again
    coordinator.set(Keys.outcome(4), COMMITTED)
    kept.restore(worker, now=KEPT_CHECK)
    attacker.delete(Keys.result(4, "w0"))
    kept.restore(worker, now=2 * KEPT_CHECK)
    assert JobStore(raw, "j", SECRET).get(Keys.result(4, "w0")) is None and not kept._values
