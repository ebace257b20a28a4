"""Notices: what the person who started a job must see on the console as it happens.

Most of what a coordinator or a worker logs is for its log file. A few things change what the
user gets and must reach the console at once, as one line each: a damaged checkpoint skipped
(and which one the job resumes from instead), a resume from a checkpoint, a failed final save
and the wait for space before the next attempt.

``notice(text)`` logs ``text`` (logger ``liveshard.notice``, level WARNING: in a pod that is
the console) and, where ``$LIVESHARD_NOTICES`` names a file (``run-local`` sets it for every
process it starts), appends it there as a JSON line ``{"time", "pid", "text"}``; the run's
console printer (``dev/localrun/progress.py``) prints each new line once. One ``write`` of a
line opened for appending: lines of several processes never interleave. Never raises.
Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

NOTICES_ENV = "LIVESHARD_NOTICES"
log = logging.getLogger("liveshard.notice")


def notice(text: str) -> None:
    log.warning("%s", text)
    path = os.environ.get(NOTICES_ENV)
    if not path:
        return
    line = json.dumps({"time": time.time(), "pid": os.getpid(), "text": text}) + "\n"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
