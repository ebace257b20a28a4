"""`local-cluster up` claims its --dir atomically: a second `up` there is refused at once."""

from __future__ import annotations

import os
import subprocess

import pytest

from liveshard.dev.commands.local_cluster import _claim
from liveshard.runtime.errors import ConfigError


def test_a_live_claim_is_refused_and_a_stale_one_replaced(tmp_path):
    pid_file = tmp_path / "local-cluster.pid"
    _claim(pid_file)
    assert pid_file.read_text() == str(os.getpid())
    with pytest.raises(ConfigError) as e:  # this process is alive: a second `up` is refused
        _claim(pid_file)
    assert e.value.field == "--workdir" and "already runs" in str(e.value)
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid_file.write_text(str(gone.pid))  # its process is gone
    _claim(pid_file)
    assert pid_file.read_text() == str(os.getpid())
