"""Child processes that end with the process that started them, even when it is SIGKILLed.

A local run, the local cluster and the demo start processes (a coordinator, workers, pods, the
operator) that must not outlive them: an orphan keeps its port, its checkpoint directory and
its CPU. An exit handler cannot help when the parent is killed with SIGKILL (a CI timeout, the
OOM killer), so the kernel does it: ``PR_SET_PDEATHSIG`` asks for SIGKILL to the child when its
parent goes.

Two ways to set it:

* ``preexec(parent)`` for ``subprocess.Popen(preexec_fn=...)``: set between fork and exec, then
  ``getppid()`` is checked against the parent's pid taken before the fork, which closes the race
  of a parent that died before the setting took effect (the child then kills itself);
* ``bind_to_parent(parent)`` at the start of a child that was not started through Popen (a
  ``multiprocessing`` spawn child): the same, from inside.

The signal is sent when the **thread** that forked the child ends, not only the process:
children must be started from a thread that lives as long as they should (the main thread, or
a loop that runs until the children are stopped anyway, as the local cluster's node agent).

Children are also started in a session (process group) of their own by their callers, so that
a deliberate stop (``os.killpg``) ends what they started too. What a child starts itself (the
worker's pulse, megatron's checkpoint writer) watches its own parent: the pulse exits when its
worker is gone, a checkpoint writer ends with its write.

Linux only; elsewhere these are no-ops (``supported()`` says which). Standard library only:
imported before torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def supported() -> bool:
    return sys.platform.startswith("linux")


def _prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except Exception:  # no libc prctl (not Linux)
        return None


def _bind(prctl: Callable[..., int] | None, parent: int, sig: int) -> bool:
    if prctl is None or int(prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the setting took effect
        os.kill(os.getpid(), sig)
    return True


def bind_to_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """In the child: get ``sig`` when the process (thread) that started it ends; if ``parent``
    (its pid, as the parent saw it before the child started) is gone already, die now. False
    where it cannot be set (not Linux)."""
    return supported() and _bind(_prctl(), parent, sig)


def preexec(parent: int | None = None, sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that binds the child to this process
    (``bind_to_parent``); None where it cannot (not Linux). Everything it needs is looked up
    here, in the parent: the child between fork and exec imports nothing (another thread may
    have held the import lock when it forked)."""
    if not supported():
        return None
    pid = os.getpid() if parent is None else parent
    prctl = _prctl()
    if prctl is None:
        return None

    def bind() -> None:  # pragma: no cover - runs in the child between fork and exec
        with contextlib.suppress(Exception):
            _bind(prctl, pid, sig)

    return bind
