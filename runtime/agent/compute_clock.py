"""How long this rank computed in a step, apart from the time it waited for its peers.

In synchronous training every rank's step takes the same wall time: a fast rank waits for a slow
one in the pipeline's send/receive and in the data-parallel all-reduce. So a rank's step time
says nothing about its own speed; its *compute* time does. megatron-core's schedules already
mark where compute starts and stops: they call ``config.timers('forward-compute').start()`` /
``.stop()`` around each micro-batch's forward (loss included) and ``'backward-compute'`` around
its backward, while the pipeline's p2p calls and the gradient all-reduce sit outside those
marks. ``ComputeClock`` is an object with megatron's ``Timers`` interface that times exactly
those two names and ignores every other one.

megatron's own ``Timers`` would serve, but it synchronises the GPU at every start and stop; the
clock records CUDA events instead and reads them once per step (``end_step``), after the
optimizer step has synchronised anyway. On CPU the clock is the training thread's CPU time: a
process descheduled on a busy host has not computed more slowly (on a GPU the events likewise
time the kernels, not the host), so a shared machine's noise does not make a straggler.

``gate``: called at the end of each compute segment with its seconds (on CPU: its CPU seconds);
the time it takes counts as compute (dev tooling sleeps there to emulate a slow device; None in
production).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

COMPUTE_TIMERS = ("forward-compute", "backward-compute")

# Called at the end of every compute segment with its seconds; what it spends counts as compute.
ComputeGate = Callable[[float], None]


class _Idle:
    """A timer megatron may start and stop that is not compute: nothing is measured."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_IDLE = _Idle()


class _Segment:
    def __init__(self, clock: ComputeClock) -> None:
        self.clock = clock
        self._t0 = 0.0
        self._event: Any = None

    def start(self, barrier: bool = False) -> None:
        if self.clock.cuda:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._t0 = time.thread_time()

    def stop(self, barrier: bool = False) -> None:
        clock = self.clock
        if clock.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            clock._events.append((self._event, end))
            return
        computed = time.thread_time() - self._t0
        if clock.gate is not None:
            gated = time.perf_counter()
            clock.gate(computed)
            computed += time.perf_counter() - gated
        clock._seconds += computed


class ComputeClock:
    """megatron ``Timers``-compatible: sums forward and backward compute per step."""

    def __init__(self, cuda: bool | None = None, gate: ComputeGate | None = None) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.gate = gate
        self._segments = {name: _Segment(self) for name in COMPUTE_TIMERS}
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        return self._segments.get(name, _IDLE)

    def begin_step(self) -> None:
        self._seconds = 0.0
        self._events.clear()

    def end_step(self) -> float:
        """Seconds of compute since ``begin_step`` (on a GPU: waits for the events' kernels)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self._seconds

    # megatron's Timers API beyond __call__ (writing timers to a log): nothing to write.
    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def write(self, *args: Any, **kwargs: Any) -> None:
        pass
