"""Rank 0's report that training finished (``WorkerAgent._report_finished``) reaches a coordinator
restarted during the final save: the write is tried again on the store the control thread
reconnected to, for ``FINISHED_REPORT_PATIENCE`` seconds; then the error stands (the process exits
non-zero and its pod is made again)."""

from __future__ import annotations

import pytest

from liveshard.runtime.agent import final_save
from liveshard.runtime.agent.worker import WorkerAgent
from liveshard.runtime.contract.keys import Keys


class Store:
    def __init__(self, fails: int) -> None:
        self.fails, self.values = fails, {}

    def set_json(self, key: str, value: dict) -> None:
        if self.fails:
            self.fails -= 1
            raise ConnectionResetError("the store's process is gone")
        self.values[key] = value


class Agent:
    """What ``_report_finished`` touches: the calling thread's store client (which the control
    thread swaps for a restarted coordinator's)."""

    def __init__(self, stores: list[Store]) -> None:
        self.stores = stores

    @property
    def store(self) -> Store:
        return self.stores[0] if self.stores[0].fails else self.stores[-1]


def test_the_report_reaches_the_restarted_coordinators_store(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    old, new = Store(fails=3), Store(fails=0)
    record = final_save.finished_record(100, 400, "/ckpt/final", 3, 0.0)
    WorkerAgent._report_finished(Agent([old, new]), record)  # type: ignore[arg-type]
    assert new.values == {Keys.FINISHED: record}


def test_past_its_patience_the_error_stands(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr("time.sleep", sleep)
    with pytest.raises(ConnectionResetError):
        WorkerAgent._report_finished(Agent([Store(fails=10**6)]), {"step": 1})  # type: ignore[arg-type]
    assert final_save.FINISHED_REPORT_PATIENCE <= clock[0] <= final_save.FINISHED_REPORT_PATIENCE + 1
