"""Objects of a retired world are kept until the next step starts, then freed off the pause."""

from __future__ import annotations

import gc
import time
import weakref

from liveshard.runtime.comms import release


class _Held:
    pass


def _gone(ref: weakref.ref, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < end:
        time.sleep(0.01)
    return ref() is None


def test_retired_objects_live_until_the_next_step_starts_then_go():
    gc.disable()  # only the release thread's dropped reference may free it
    try:
        obj = _Held()
        ref = weakref.ref(obj)
        release.later([obj])
        del obj
        time.sleep(0.1)
        assert ref() is not None  # a switch's pause never pays for its destructor
        release.start()  # the next step starts: handed to the release thread, which drops it
        assert _gone(ref)
    finally:
        gc.enable()


def test_each_step_start_frees_only_what_was_retired_before_it():
    first, second = _Held(), _Held()
    r1, r2 = weakref.ref(first), weakref.ref(second)
    release.later(first)
    release.start()
    release.later(second)
    del first, second
    assert _gone(r1)
    time.sleep(0.1)
    assert r2() is not None
    release.start()
    assert _gone(r2)
