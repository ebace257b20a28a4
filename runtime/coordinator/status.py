"""The coordinator's status report: one typed record, written to the store
(``Keys.COORDINATOR_STATUS``) and handed to the plan source (the operator turns it into the
job's status)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from liveshard.runtime.contract.times import iso
from liveshard.runtime.contract.training import TrainingSpec
from liveshard.runtime.control.protocol import WorldPlan


@dataclass(frozen=True)
class CoordinatorStatus:
    generation: int | None
    config: str | None
    members: list[str]
    standbys: list[str]
    pending: int | None  # the generation being switched to
    dead: list[str]  # the liveness judge's verdict (coordinator.membership): nobody judges again
    history: list[dict[str, Any]]  # control.protocol.GenerationOutcome, as dicts
    telemetry: dict[str, dict[str, Any]]  # each member's last valid heartbeat
    health: dict[str, Any]  # speeds, stragglers, the adaptive policy (control.stragglers)
    progress: dict[str, Any] | None
    finished: dict[str, Any] | None
    failure: dict[str, Any] | None  # terminal: reason, message, time
    checkpoints: dict[str, Any]  # latest, failed, unavailable
    contested: list[str] = field(default_factory=list)  # members whose heartbeat key was tampered with
    tampering: dict[str, int] = field(default_factory=dict)  # store values refused, by kind
    # what the coordinator waits for, in words (``CoordinatorCore.waiting``); the job's ``status.waiting``
    waiting: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """As it goes into the store (``Keys.COORDINATOR_STATUS``)."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)


def progress_of(current: WorldPlan | None, telemetry: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Where training is, from the running world's members' heartbeats: step, samples, the
    last loss (the last pipeline stage knows it), the median step time."""
    if current is None:
        return None
    beats = [telemetry[m] for m in current.members if m in telemetry]
    steps = [int(b["step"]) for b in beats if b.get("step") is not None]
    if not steps:
        return None
    step = max(steps)
    loss = next((b["loss"] for b in beats if b.get("step") == step and b.get("loss") is not None), None)
    seconds = sorted(float(b["step_seconds"]) for b in beats if b.get("step_seconds"))
    consumed = max((int(b["consumed_samples"]) for b in beats if b.get("consumed_samples") is not None),
                   default=None)
    return {"step": step, "loss": loss, "consumed_samples": consumed,
            "step_seconds": seconds[len(seconds) // 2] if seconds else None}


def progress_with_eta(progress: dict[str, Any] | None, training: TrainingSpec | None,
                      wall: float | None = None) -> dict[str, Any] | None:
    """``progress`` (``CoordinatorCore.progress``) with the job's trainIters, tokens/s and ETA."""
    if progress is None:
        return None
    wall = time.time() if wall is None else wall
    out = {**progress, "time": wall}
    if training is not None:
        out["train_iters"] = training.train_iters
        step_seconds = progress.get("step_seconds")
        if step_seconds:
            out["tokens_per_second"] = training.global_batch * training.seq_length / step_seconds
            out["eta"] = iso(wall + max(0, training.train_iters - int(progress["step"])) * step_seconds)
    return out
