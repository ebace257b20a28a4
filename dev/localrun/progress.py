"""A line per step on the console while a local run trains: what the workers' step logs say.

Every worker appends a JSON line per step to ``WORKDIR/<id>.steps.jsonl`` (``--step-log``).
``StepPrinter`` reads what was added since its last look, every ``period`` seconds in a thread
of its own, and prints each step once, when a record with its loss (the last pipeline stage's)
is there: ``step 3/9  loss 6.9186  world 2  lr 1.00e-03  0.84 s``. A step trained again (a
recovery that rolled back to a checkpoint) is printed again, with its generation.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path


class StepPrinter:
    def __init__(self, directory: Path, total_steps: int, say: Callable[[str], None], period: float = 0.5) -> None:
        self.directory = directory
        self.total = total_steps
        self.say = say
        self.period = period
        self._offsets: dict[Path, int] = {}
        self._printed: set[tuple[int, int]] = set()  # (step, generation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StepPrinter:
        self._thread = threading.Thread(target=self._loop, name="step-printer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Print what is left, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.poll()

    def poll(self) -> None:
        records = []
        for path in sorted(self.directory.glob("*.steps.jsonl")):
            records += self._new_lines(path)
        for rec in sorted(records, key=lambda r: (r.get("generation", 0), r.get("step", 0))):
            key = (int(rec.get("step") or 0), int(rec.get("generation") or 0))
            if rec.get("loss") is None or key in self._printed:
                continue
            again = any(step == key[0] for step, _ in self._printed)
            self._printed.add(key)
            self.say(self.line(rec, again))

    def line(self, rec: dict, again: bool = False) -> str:
        parts = [f"step {rec['step']}/{self.total}", f"loss {rec['loss']:.4f}", f"world {rec.get('world_size')}"]
        if rec.get("lr") is not None:
            parts.append(f"lr {rec['lr']:.2e}")
        if rec.get("seconds"):
            parts.append(f"{rec['seconds']:.2f} s")
        if rec.get("skipped"):
            parts.append("skipped (fp16 overflow)")
        if again:
            parts.append(f"again, generation {rec.get('generation')}")
        return "  ".join(parts)

    def _new_lines(self, path: Path) -> list[dict]:
        """Complete lines added to ``path`` since the last look (a line still being written is
        left for the next one)."""
        start = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[path] = start + end
        out = []
        for raw in data[:end].splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
        return out
