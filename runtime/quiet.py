"""Third-party noise kept off the console: what torch and megatron-core print that is no news to
the person who ran a command.

* ``install()`` (run when ``liveshard.runtime`` is imported, before torch): on a machine with the
  CUDA toolkit but no GPU (a CUDA image on a CPU node: ``nvcc`` on PATH), a CUDA build of torch
  logs ``No CUDA runtime is found, using CUDA_HOME=...`` when ``torch.utils.cpp_extension`` is
  imported (megatron-core imports it), through a logger nobody configured: Python's last-resort
  handler made it the first stderr line of every command, so a one-line error had two. That
  record is dropped (it says nothing a CPU run needs). And where ``$LIVESHARD_WARNINGS_LOG``
  names a file, third-party warnings go there (``warnings_to``): processes a command spawns
  (``multiprocessing``) import this package too, so theirs do as well.
* ``warnings_to(path)``: every warning raised outside liveshard's own code is appended to
  ``path`` (each distinct message once, whichever process wrote it first) instead of printed;
  ``None``: dropped. liveshard's own warnings still reach the console. ``run-local`` sends its
  processes' to ``WORKDIR/warnings.log``, the demo its own and its pods' to its logs directory
  (through the variable); ``convert``,
  which has no log file, to ``os.devnull`` (megatron-core's "Transformer Engine and Apex are not
  installed", torch's FutureWarnings) unless ``$LIVESHARD_WARNINGS_LOG`` says where; through
  the variable, so that the processes it spawns do the same.

Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

WARNINGS_ENV = "LIVESHARD_WARNINGS_LOG"
CUDA_HOME_LOGGER = "torch.utils.cpp_extension"
CUDA_HOME_LINE = "No CUDA runtime is found"
_OWN = Path(__file__).resolve().parent.parent  # liveshard's package root: its own warnings stay


class _NoCudaRuntimeLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CUDA_HOME_LINE)


def _own(filename: str) -> bool:
    """Whether ``filename`` is liveshard's code (not a package installed beside or inside it)."""
    try:
        rel = Path(filename).resolve().relative_to(_OWN)
    except (OSError, ValueError):
        return False
    return "site-packages" not in rel.parts and not (rel.parts and rel.parts[0].startswith("."))


_routed: dict[str, Any] = {}
_lock = threading.Lock()


def install() -> None:
    logger = logging.getLogger(CUDA_HOME_LOGGER)
    if not any(isinstance(f, _NoCudaRuntimeLine) for f in logger.filters):
        logger.addFilter(_NoCudaRuntimeLine())
    path = os.environ.get(WARNINGS_ENV)
    if path:
        warnings_to(path)


def warnings_to(path: str | os.PathLike | None) -> None:
    """Warnings raised outside liveshard go to ``path`` (appended, each distinct one once;
    None: dropped) instead of the console; liveshard's own are shown as before."""
    original = _routed.get("original") or warnings.showwarning
    seen: set[tuple[str, str]] = set()
    target = None if path is None else str(path)

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if _own(filename):
            original(message, category, filename, lineno, file, line)
            return
        key = (category.__name__, str(message))
        with _lock:
            if key in seen:
                return
            seen.add(key)
        if target is None:
            return
        text = warnings.formatwarning(message, category, filename, lineno, line)
        with contextlib.suppress(OSError), open(target, "a+", encoding="utf-8") as f:
            f.seek(0)
            if f"{category.__name__}: {message}" not in f.read():  # once in the file, whoever wrote it first
                f.write(text)

    _routed["original"] = original
    warnings.showwarning = show
