"""The executor's round logic, checked in one process (no spawned ranks, no process group).

``liveshard.runtime.transfer.rounds`` says, from a plan, its schedule and a device id, what the
device copies locally, what it sends and receives in each round and in which messages, which old
tensors it frees after which round, and which P2P rounds are on the wire at once. These tests
run it for every device of a few transitions and check the properties the executor relies on;
the last ones run ``execute`` itself in one process, on transitions a single device does alone.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from liveshard.dev.reshard.cases import SPECS, Case
from liveshard.dev.reshard.reference import check_reference, fill_reference
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.transfer import executor, packing, rounds
from liveshard.runtime.transfer.storage import LocalShards, view_of
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.schedule import schedule
from liveshard.runtime.vps.shards import local_tensor_shapes
from liveshard.runtime.vps.transition import plan_transition

CASES = [
    Case("dp-shrink-leaver", "tiny-gpt", "tp=2,pp=1,dp=4", "tp=2,pp=1,dp=3", leave="4,5", gpus_per_node=2),
    Case("tp-change", "tiny-llama", "tp=2,pp=2,dp=1", "tp=1,pp=2,dp=2", gpus_per_node=2, budget=3000),
    Case("pp-change-joiner", "tiny-gpt", "tp=1,pp=2,dp=2,layers=1+3", "tp=1,pp=3,dp=2,layers=2+1+1",
         join=2, gpus_per_node=2, budget=8192),
    Case("dist-opt-shrink", "tiny-llama", "tp=1,pp=2,dp=3,dist_opt", "tp=1,pp=2,dp=2,dist_opt",
         leave="5", gpus_per_node=2, budget=4096),
    Case("dist-opt-mixed-dtypes-grow", "tiny-llama-bf16", "tp=2,pp=1,dp=2,dist_opt", "tp=2,pp=1,dp=4,dist_opt",
         join=4, gpus_per_node=2, budget=6000),
]
DIRECT_MIN_BYTES = (256, packing.DIRECT_MIN_BYTES)  # both message kinds, and packed only


def case_ids(c: Case) -> str:
    return c.name


def devices_of(plan) -> range:
    return range(plan.devices.num_devices)


def kept_of(plan, d: int) -> rounds.Kept:
    new_rank = rounds.new_rank_of(plan, d)
    return {} if new_rank is None else rounds.kept_in_place(plan, d, new_rank)


def counters(shapes: dict) -> LocalShards:
    return LocalShards({s: {n: torch.zeros(shape, dtype=torch.int32) for n, shape in per.items()}
                      for s, per in shapes.items()})


def mark(store: LocalShards, plan, ch, src_side: bool) -> None:
    for state, view, rel in rounds.piece_refs(plan, ch, src_side):
        packing.piece(store, state, view, rel, ch).add_(1)


# the pure round logic, every device of each transition


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_every_new_element_is_written_exactly_once_and_received_bytes_are_the_minimum(case):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    must = plan.lower_bound["must_receive"]
    for d in devices_of(plan):
        per_round = rounds.device_rounds(plan, sched, d)
        assert len(per_round) == sched.rounds
        received = sum(rounds.round_bytes(recvs) for _, recvs in per_round)
        assert received == must[d], f"device {d}"
        new_rank = rounds.new_rank_of(plan, d)
        if new_rank is None:
            assert received == 0 and not rounds.local_copies(plan, d, {})
            continue
        shapes = local_tensor_shapes(plan.new_layout, new_rank)
        got, want = counters(shapes), counters(shapes)
        for reg in plan.new_layout.regions(new_rank):
            view_of(want.get(reg.state, reg.local_name), (reg.local_name, reg.local_offset, reg.local_shape)).add_(1)
        kept = kept_of(plan, d)
        for state, name in kept:  # an old tensor kept in place: all there already
            got.get(state, name).add_(1)
        for ci in rounds.local_copies(plan, d, kept):
            mark(got, plan, rounds.whole_copy(plan, ci), src_side=False)
        for _, recvs in per_round:
            for chs in recvs.values():
                for ch in chs:
                    mark(got, plan, ch, src_side=False)
        for state, name, t in want.items():
            assert torch.equal(got.get(state, name), t), f"device {d} {state} {name}"


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_local_copies_are_exactly_what_a_device_already_holds(case):
    plan = case.plan()
    for d in range(plan.devices.old_world):
        new_rank = rounds.new_rank_of(plan, d)
        if new_rank is None:
            continue
        for state in plan.new_layout.states:
            held: dict[str, torch.Tensor] = {}  # key -> per global element: new regions held before too
            old_has: dict[str, torch.Tensor] = {}
            for reg in plan.old_layout.regions(d, (state,)):
                box = old_has.setdefault(reg.key, torch.zeros(reg.global_shape, dtype=torch.bool))
                box[tuple(slice(o, o + s) for o, s in zip(reg.global_offset, reg.box_shape))] = True
            for reg in plan.new_layout.regions(new_rank, (state,)):
                box = held.setdefault(reg.key, torch.zeros(reg.global_shape, dtype=torch.int32))
                box[tuple(slice(o, o + s) for o, s in zip(reg.global_offset, reg.box_shape))] += 1
            copied = {k: torch.zeros_like(v) for k, v in held.items()}
            for c in plan.copies:
                if c.src == d == c.dst and state in plan.groups[c.group].states:
                    shape = (1,) * (len(c.offset) - len(c.shape)) + c.shape
                    copied[c.key][tuple(slice(o, o + s) for o, s in zip(c.offset, shape))] += 1
            for key, count in held.items():
                want = count * old_has[key] if key in old_has else torch.zeros_like(count)
                assert torch.equal(copied[key], want), f"device {d} {state} {key}"
        # the executor skips exactly the local copies into old tensors kept in place
        kept = kept_of(plan, d)
        every = [ci for ci, c in enumerate(plan.copies) if c.src == d == c.dst]
        run = rounds.local_copies(plan, d, kept)
        skipped = [ci for ci in every if all((s, plan.copies[ci].dst_view[0]) in kept
                                             for s in plan.groups[plan.copies[ci].group].states)]
        assert run == [ci for ci in every if ci not in skipped]


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_kept_tensors_have_the_old_shape_and_only_surviving_replicas_move_nothing(case):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    if case.name == "dp-shrink-leaver":  # the leavers' replicas survive elsewhere: all stays in place
        assert sched.rounds == 0 and not plan.network_copies
        for d in plan.rank_to_device:
            assert len(kept_of(plan, d)) == sum(map(len, local_tensor_shapes(plan.old_layout, d).values()))
    else:
        assert sched.rounds > 1 and plan.network_copies
    for d in devices_of(plan):
        for (state, name), src in kept_of(plan, d).items():
            old = local_tensor_shapes(plan.old_layout, d)[state][src]
            new = local_tensor_shapes(plan.new_layout, plan.device_to_rank[d])[state][name]
            assert tuple(old) == tuple(new)


@pytest.mark.parametrize("direct_min_bytes", DIRECT_MIN_BYTES)
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_sends_and_receives_pair_up_in_the_same_round_and_message_order(case, direct_min_bytes):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    per_device = {d: rounds.device_rounds(plan, sched, d) for d in devices_of(plan)}
    for d, per_round in per_device.items():
        for r, (sends, recvs) in enumerate(per_round):
            for p, chs in sends.items():
                assert p != d
                assert per_device[p][r][1].get(d) == chs, f"round {r}: {d} -> {p}"
            for p, chs in recvs.items():
                assert per_device[p][r][0].get(d) == chs, f"round {r}: {d} <- {p}"
            # the P2P messages of a pair: same kinds, chunks and sizes, in the same order
            for p in sends:
                out = rounds.message_layout(plan, {p: sends[p]}, direct_min_bytes, src_side=True)
                into = rounds.message_layout(plan, {d: per_device[p][r][1][d]}, direct_min_bytes, src_side=False)
                assert [_wire(m) for m in out] == [_wire(m) for m in into]
                assert len(out) >= 1


def _wire(m: rounds.Message) -> tuple:
    if isinstance(m, rounds.Packed):
        return ("packed", m.chunks, m.staging)
    return ("direct", m.chunk, m.state)


@pytest.mark.parametrize("direct_min_bytes", DIRECT_MIN_BYTES)
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_round_staging_stays_within_the_budget_and_every_chunk_goes_in_one_message(case, direct_min_bytes):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    direct_seen = False
    for d in devices_of(plan):
        for sends, recvs in rounds.device_rounds(plan, sched, d):
            chunks = [ch for side in (sends, recvs) for chs in side.values() for ch in chs]
            bound = sum(ch.staging for ch in chunks)  # what all-to-all stages, and P2P at most
            assert bound <= sched.budget
            msgs = [m for side, src in ((sends, True), (recvs, False))
                    for m in rounds.message_layout(plan, side, direct_min_bytes, src)]
            packed = [ch for m in msgs if isinstance(m, rounds.Packed) for ch in m.chunks]
            direct = [m for m in msgs if isinstance(m, rounds.Direct)]
            direct_seen = direct_seen or bool(direct)
            for ch in chunks:  # packed once, or sent as one message per state
                n_states = len(plan.groups[plan.copies[ch.copy].group].states)
                in_packed = packed.count(ch)
                as_direct = sum(1 for m in direct if m.chunk == ch)
                assert (in_packed, as_direct) in ((1, 0), (0, n_states))
                assert (as_direct > 0) == (ch.staging >= direct_min_bytes)
            assert sum(m.staging for m in msgs if isinstance(m, rounds.Packed)) <= bound
    if direct_min_bytes == packing.DIRECT_MIN_BYTES:
        assert not direct_seen  # budgets of a few KiB: no chunk reaches 1 MiB


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_old_tensors_are_freed_once_after_their_last_read(case):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    for d in range(plan.devices.old_world):
        kept = kept_of(plan, d)
        frees = rounds.release_schedule(plan, sched, d, kept)
        when = {}
        for r, tensors in frees.items():
            assert -1 <= r < sched.rounds
            for t in tensors:
                assert t not in when, f"device {d} frees {t} twice"
                when[t] = r
        old_shapes = local_tensor_shapes(plan.old_layout, d)
        assert all(name in old_shapes[state] for state, name in when)
        assert not set(kept.values()) & {name for _, name in when}
        read = {}  # (state, name) -> last round it is read in (-1: local copies)
        for ci in rounds.local_copies(plan, d, kept):
            for state, view, _ in rounds.piece_refs(plan, rounds.whole_copy(plan, ci), src_side=True):
                read.setdefault((state, view[0]), -1)
        for r, (sends, _) in enumerate(rounds.device_rounds(plan, sched, d)):
            for chs in sends.values():
                for ch in chs:
                    for state, view, _ in rounds.piece_refs(plan, ch, src_side=True):
                        read[state, view[0]] = r
        for t, last in read.items():
            if t[1] in kept.values():
                continue
            assert when.get(t) == last, f"device {d}: {t} read last in round {last}, freed after {when.get(t)}"


def simulate_posting(stagings: list[int], budget: int, ahead: bool) -> tuple[list, rounds.PostingWindow]:
    """The executor's P2P loop with rounds that only have a staging size."""
    window = rounds.PostingWindow(len(stagings), budget, ahead)
    events = []
    for r in range(len(stagings)):
        while (nxt := window.next_to_post(r)) is not None:
            if not window.fits(r, nxt, stagings[nxt]):
                break
            window.posted(nxt, stagings[nxt])
            events.append(("post", nxt))
            assert len(window.in_flight) == 1 or window.live <= budget
        nxt = window.next_to_post(r)
        if ahead and nxt is not None and nxt > r:  # greedy: stopped only by the budget
            assert window.live + stagings[nxt] > budget
        assert window.complete_oldest() == r
        events.append(("done", r))
    assert not window.in_flight and window.live == 0
    return events, window


def test_posting_window_posts_each_round_once_in_order_within_the_budget():
    stagings = [40, 10, 30, 30, 0, 100, 5, 5, 60]
    events, window = simulate_posting(stagings, budget=70, ahead=True)
    posts = [r for kind, r in events if kind == "post"]
    assert posts == list(range(len(stagings)))
    for r in range(len(stagings)):
        assert events.index(("post", r)) < events.index(("done", r))
    assert window.max_in_flight == 4  # rounds 1-4 while round 1 is due: 10 + 30 + 30 + 0 bytes
    assert window.peak_live == 100  # a round over the budget still goes, alone
    events, window = simulate_posting(stagings, budget=70, ahead=False)
    assert events == [e for r in range(len(stagings)) for e in (("post", r), ("done", r))]
    assert window.max_in_flight == 1


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_posting_ahead_on_real_rounds_keeps_every_posted_round_within_the_budget(case):
    plan = case.plan()
    sched = schedule(plan, case.budget)
    for d in devices_of(plan):
        stagings = [sum(m.staging for side, src in ((s, True), (rv, False))
                        for m in rounds.message_layout(plan, side, packing.DIRECT_MIN_BYTES, src))
                    for s, rv in rounds.device_rounds(plan, sched, d)]
        _, window = simulate_posting(stagings, sched.budget, ahead=True)
        assert window.peak_live <= sched.budget


@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_round_logic_is_deterministic(case):
    def summary():
        plan = case.plan()
        sched = schedule(plan, case.budget)
        out = []
        for d in range(plan.devices.num_devices + 1):  # and a process beyond the plan's devices
            kept = kept_of(plan, d)
            per_round = rounds.device_rounds(plan, sched, d)
            out.append((kept, rounds.local_copies(plan, d, kept), per_round,
                        [[rounds.message_layout(plan, side, 256, src) for side, src in ((s, True), (rv, False))]
                         for s, rv in per_round],
                        rounds.release_schedule(plan, sched, d, kept), rounds.received_by_peer(per_round)))
        return out

    first, second = summary(), summary()
    assert first == second
    assert first[-1][2] == [({}, {})] * len(first[-1][2])  # a spare process moves nothing


def test_local_copies_overlap_the_first_p2p_rounds_only():
    assert rounds.local_copies_overlap_rounds(executor.P2P, 3)
    assert not rounds.local_copies_overlap_rounds(executor.P2P, 0)
    assert not rounds.local_copies_overlap_rounds(executor.A2A, 3)
    assert executor.DEFAULT_MODE in executor.MODES


# execute itself, in one process: transitions a single device does alone (no messages)


SOLO = [
    ("same-layout", "tiny-llama", "tp=1,pp=1,dp=1", "tp=1,pp=1,dp=1"),
    ("to-dist-opt", "tiny-llama-bf16", "tp=1,pp=1,dp=1", "tp=1,pp=1,dp=1,dist_opt"),
    ("from-dist-opt", "tiny-gpt", "tp=1,pp=1,dp=1,dist_opt", "tp=1,pp=1,dp=1"),
]


def solo_plan(model: str, old: str, new: str):
    plan = plan_transition(SPECS[model], ParallelConfig.parse(old), ParallelConfig.parse(new), DeviceMap(1))
    sched = schedule(plan, 1 << 16)
    assert sched.rounds == 0 and not plan.network_copies
    return plan, sched


@pytest.mark.parametrize("release_old", [False, True])
@pytest.mark.parametrize("preallocate", [False, True])
@pytest.mark.parametrize(("name", "model", "old", "new"), SOLO, ids=[s[0] for s in SOLO])
def test_execute_alone_without_a_process_group_is_bit_exact(name, model, old, new, preallocate, release_old):
    plan, sched = solo_plan(model, old, new)
    store = fill_reference(plan.old_layout, 0)
    before = {(s, n): t for s, n, t in store.items()}
    before_tensors = {s: dict(per) for s, per in store.tensors.items()}
    old_bytes = store.nbytes()
    objects = {"step": 7, "rng": {"owner": 0}}
    destinations = executor.allocate_destinations(plan, 0) if preallocate else None
    result = executor.execute(plan, sched, 0, store, objects, group=None, release_old=release_old,
                              destinations=destinations)
    assert check_reference(plan.new_layout, 0, result.shards) == []
    assert result.objects["step"] == 7 and result.objects["rng"] == {"owner": 0}
    s = result.stats
    assert s.bytes_sent == s.bytes_received == 0 and s.round_seconds == [] and s.max_rounds_in_flight == 0
    kept = rounds.kept_in_place(plan, 0, 0)
    assert s.aliased_bytes == sum(result.shards.get(st, n).nbytes for st, n in kept)
    for (st, n), src in kept.items():
        assert result.shards.get(st, n) is before[st, src]
    new_bytes = result.shards.nbytes()
    if destinations is not None:  # written in place: every new tensor is kept or was allocated ahead
        assert all(result.shards.get(st, n) is t for st, n, t in destinations.items())
        assert new_bytes == s.aliased_bytes + destinations.nbytes()
    if release_old:  # every old tensor is gone but those named like one kept in place (any state)
        kept_names = set(kept.values())
        left = {(st, n) for st, n, _ in store.items()}
        assert left == {(st, n) for st, n, _ in LocalShards(before_tensors).items() if n in kept_names}
        assert s.peak_extra_bytes <= new_bytes - s.aliased_bytes
    else:
        assert check_reference(plan.old_layout, 0, store) == []
        assert store.nbytes() == old_bytes
        assert s.peak_extra_bytes == new_bytes - s.aliased_bytes
    if name == "same-layout":
        assert s.local_bytes == 0 and s.aliased_bytes == old_bytes and s.peak_extra_bytes == 0
    else:
        assert s.local_bytes > 0


@pytest.fixture
def solo_group():
    store = dist.HashStore()
    return dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))


@pytest.mark.parametrize("mode", ["p2p", "a2a"])
def test_execute_alone_verifies_over_a_standalone_group(solo_group, mode):
    plan, sched = solo_plan("tiny-llama-bf16", "tp=1,pp=1,dp=1", "tp=1,pp=1,dp=1,dist_opt")
    store = fill_reference(plan.old_layout, 0)
    result = executor.execute(plan, sched, 0, store, {}, mode=mode, verify=True, group=solo_group, ranks=[0])
    assert result.stats.verified
    assert check_reference(plan.new_layout, 0, result.shards) == []
    assert check_reference(plan.old_layout, 0, store) == []


def test_execute_rejects_an_unknown_mode():
    plan, sched = solo_plan("tiny-gpt", "tp=1,pp=1,dp=1", "tp=1,pp=1,dp=1")
    with pytest.raises(ValueError, match="mode must be one of"):
        executor.execute(plan, sched, 0, fill_reference(plan.old_layout, 0), mode="carrier-pigeon")


def test_a_destination_of_the_wrong_shape_is_refused():
    plan, sched = solo_plan("tiny-llama-bf16", "tp=1,pp=1,dp=1", "tp=1,pp=1,dp=1,dist_opt")
    dest = executor.allocate_destinations(plan, 0)
    state, name, t = next(iter(dest.items()))
    dest.tensors[state][name] = torch.empty(t.numel() + 1, dtype=t.dtype)
    with pytest.raises(executor.TransferError, match="the plan needs"):
        executor.execute(plan, sched, 0, fill_reference(plan.old_layout, 0), destinations=dest)
