"""The small objects a transition moves between ranks: exact, and never unpickled."""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
import torch

from liveshard.runtime.transfer.objects import InvalidObjects, decode, encode


def test_rng_states_and_schedulers_come_back_exactly():
    random.seed(7)
    gen = torch.Generator().manual_seed(11)
    obj = {"step": 1000, "data_cursor": 512_000,
           "scheduler": {"max_lr": 3e-4, "min_lr": 0.0, "decay_style": "cosine", "num_steps": 1000,
                         "wd_incr_style": None, "warmup": 0.1 + 0.2},
           "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                   "tracker": {"model-parallel-rng": gen.get_state()}},
           "odd": {1: (b"\x00\xff", [math.inf, -0.0]), "arr": np.arange(5, dtype=np.uint32)}}
    back = decode(encode(obj))
    assert back["step"] == 1000 and back["scheduler"] == obj["scheduler"]
    assert back["rng"]["python"] == obj["rng"]["python"]  # tuples stay tuples: setstate accepts it
    assert torch.equal(back["rng"]["torch"], obj["rng"]["torch"]) and back["rng"]["torch"].dtype == torch.uint8
    assert back["odd"][1][0] == b"\x00\xff" and back["odd"][1][1][0] == math.inf
    assert math.copysign(1.0, back["odd"][1][1][1]) == -1.0
    assert np.array_equal(back["odd"]["arr"], obj["odd"]["arr"]) and back["odd"]["arr"].dtype == np.uint32
    # a restored state continues the same stream
    random.setstate(back["rng"]["python"])
    a = random.random()
    random.setstate(obj["rng"]["python"])
    assert random.random() == a
    g2 = torch.Generator()
    g2.set_state(back["rng"]["tracker"]["model-parallel-rng"])
    assert torch.equal(torch.rand(3, generator=g2), torch.rand(3, generator=gen))


def test_anything_else_is_refused_never_executed():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(InvalidObjects):
        decode(pickle.dumps({"step": 1}))
    with pytest.raises(InvalidObjects):
        decode(b'{"__liveshard__": "object", "module": "os", "name": "system"}')
    with pytest.raises(InvalidObjects):
        decode(b'{"__liveshard__": "tensor", "dtype": "complex128", "shape": [1], "data": ""}')
    with pytest.raises(InvalidObjects):
        decode(b'{"step": 1}')  # a bare JSON object is not this format
    with pytest.raises(InvalidObjects):
        encode({"x": Evil()})
