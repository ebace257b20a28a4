"""A line per step on the console while a local run trains: what the workers' step logs say.

Every worker appends a JSON line per step to ``WORKDIR/<id>.steps.jsonl`` (``--step-log``).
``StepPrinter`` reads what was added since its last look, every ``period`` seconds in a thread
of its own, and prints each step once, when a record with its loss (the last pipeline stage's)
is there: ``step 3/9  loss 6.9186  world 2  lr 1.00e-03  0.84 s``. A step trained again (a
recovery that rolled back to a checkpoint) is printed again, with its generation.

It also prints the run's notices (``runtime/notice.py``: a damaged checkpoint skipped, a resume
from a checkpoint, a failed final save and the wait for space), each once, as they are written
to ``notices`` (the file every process of the run appends them to).

Only this run's lines: what the files held when the printer was made (an earlier run in a
reused workdir) is skipped, so its steps are never replayed as this run's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path


class StepPrinter:
    def __init__(self, directory: Path, total_steps: int, say: Callable[[str], None], period: float = 0.5,
                 notices: Path | None = None) -> None:
        self.directory = directory
        self.total = total_steps
        self.say = say
        self.period = period
        self.notices = notices
        # where this run's lines start: whatever the files hold now is an earlier run's
        self._offsets: dict[Path, int] = {f: _size(f) for f in [*directory.glob("*.steps.jsonl"),
                                                                 *([notices] if notices else [])]}
        self._printed: set[tuple[int, int]] = set()  # (step, generation)
        self._said: set[str] = set()  # notices printed (several processes may notice one thing)
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
        if self.notices is not None:
            for rec in self._new_lines(self.notices, "text", str):
                text = str(rec["text"])
                if text not in self._said:
                    self._said.add(text)
                    self.say(text)
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

    def _new_lines(self, path: Path, key: str = "step", kind: type = int) -> list[dict]:
        """Complete lines added to ``path`` since the last look (a line still being written is
        left for the next one)."""
        start = self._offsets.get(path, 0)
        if _size(path) < start:  # made anew since: all of it is new
            start = 0
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
            if isinstance(rec, dict) and isinstance(rec.get(key), kind):
                out.append(rec)
        return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
