"""Objects of a retired world, freed off the switch's critical path.

A world's teardown drops objects whose destructors are slow but whose results nobody waits for:
gloo communicators (each closes its connections and joins its threads, holding the interpreter
lock meanwhile) and, after a commit, the old world's model, optimizer and gradient buffers
(freeing gigabytes of pages). ``later`` keeps them until the new world starts its first step
(``start``): a daemon thread then drops the last references while that step computes, instead
of in the pause. Nothing here may hold state the job still needs: only what
was already torn down or committed away.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

_pending: list[Any] = []
_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def later(obj: Any, device_memory: bool = False) -> None:
    """Free ``obj`` (and what only it keeps alive) once the next training step starts.
    ``device_memory``: it holds tensors the next step may need the memory of; on an accelerator
    (whose caching allocator frees at once) it is not kept, so the caller's drop frees it."""
    if obj is None or (device_memory and torch.cuda.is_available()):
        return
    with _lock:
        _pending.append(obj)


def start() -> None:
    """A training step starts: hand what was retired before it to the release thread."""
    global _thread
    if not _pending:
        return
    with _lock:
        items = _pending[:]
        _pending.clear()
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="liveshard-release", daemon=True)
            _thread.start()
    _queue.put(items)


def _run() -> None:
    while True:
        items = _queue.get()
        items.clear()  # the last references go here, in this thread
        del items
