"""Objects of a retired world are kept until the next step starts, then freed off the pause."""

from __future__ import annotations

import gc
import weakref

from liveshard.runtime.agent import release


class _Held:
    pass


def test_retired_objects_live_until_the_next_step_starts_then_go():
    gc.disable()  # only the release thread's dropped reference may free it
    try:
        obj = _Held()
        ref = weakref.ref(obj)
        release.later([obj])
        del obj
        assert ref() is not None  # a switch's pause never pays for its destructor
        assert release.drain(10.0)  # start(): handed to the release thread, which drops it
        assert ref() is None
    finally:
        gc.enable()


def test_starting_a_step_with_nothing_retired_costs_nothing():
    release.start()
    assert release.drain(10.0)
