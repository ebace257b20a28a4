"""run-local's console: a line per step, from the workers' step logs as they grow."""

from __future__ import annotations

import json

from liveshard.dev.localrun.progress import StepPrinter


def _rec(step: int, loss: float | None, generation: int = 0, world: int = 2) -> str:
    return json.dumps({"step": step, "loss": loss, "world_size": world, "generation": generation, "lr": 1e-3,
                       "seconds": 0.5}) + "\n"


def test_each_step_is_printed_once_when_its_loss_is_logged(tmp_path):
    said: list[str] = []
    printer = StepPrinter(tmp_path, 4, said.append)
    (tmp_path / "w0.steps.jsonl").write_text(_rec(1, None) + _rec(2, None))  # a first pipeline stage: no loss
    (tmp_path / "w1.steps.jsonl").write_text(_rec(1, 6.5) + '{"step": 2, "lo')  # the last line still being written
    printer.poll()
    assert said == ["step 1/4  loss 6.5000  world 2  lr 1.00e-03  0.50 s"]
    with open(tmp_path / "w1.steps.jsonl", "a") as f:
        f.write('ss": 6.25, "world_size": 2, "generation": 0}\n')
    printer.poll()
    printer.poll()
    assert said[1:] == ["step 2/4  loss 6.2500  world 2"]
    # a recovery that rolled back trains step 2 again in another generation
    with open(tmp_path / "w1.steps.jsonl", "a") as f:
        f.write(_rec(2, 6.3, generation=3, world=1))
    printer.poll()
    assert said[2:] == ["step 2/4  loss 6.3000  world 1  lr 1.00e-03  0.50 s  again, generation 3"]
