"""``membership.Liveness``: what a broken-world report may decide against a member whose heartbeat
key is contested, and a sealed write of the member's as a sign of life."""

from __future__ import annotations

from liveshard.runtime.control.protocol import Heartbeat
from liveshard.runtime.coordinator.membership import BeatRead, Liveness


def beat(seq: int) -> BeatRead:
    return BeatRead(beat=Heartbeat(time=float(seq), seq=seq, state="training", incarnation="w.0"))


def run(sign_at: float | None) -> set[str]:
    """w1 beats until t=1, then its key holds forgeries only; its peer reports the world broken
    from t=2. With ``sign_at``, its result for the pending generation is read then."""
    judge = Liveness(timeout=1.0)
    t, seq = 0.0, 0
    while t <= 7.0:
        seq += 1
        reads = {"w1": beat(seq) if t <= 1.0 else BeatRead(beat=None, tampered=True)}
        if sign_at is not None and abs(t - sign_at) < 1e-9:
            judge.sign_of_life("w1", t)
        judge.judge(t, {"w1"}, reads, corroborated=frozenset({"w1"}) if t >= 2.0 else frozenset())
        t = round(t + 0.5, 6)
    return judge.dead


def test_the_one_suspect_is_found_dead_on_the_report_after_contest_limit():
    assert run(None) == {"w1"}


def test_a_sealed_write_read_for_the_first_time_is_a_sign_of_life():
    # a result read at t=4 (the death was due past t=4) counts as a beat then: contest_limit (3 s)
    # runs from it, past t=7
    assert run(4.0) == set()
    assert run(0.5) == {"w1"}  # one before its last beat changes nothing


def test_two_suspects_are_never_picked_by_the_report():
    judge = Liveness(timeout=1.0)
    for i in range(16):
        t = i * 0.5
        reads = {m: beat(i + 1) if t <= 1.0 else BeatRead(beat=None, tampered=True) for m in ("w1", "w2")}
        judge.judge(t, {"w1", "w2"}, reads, corroborated=frozenset({"w1", "w2"}) if t >= 2.0 else frozenset())
    assert judge.dead == set()
