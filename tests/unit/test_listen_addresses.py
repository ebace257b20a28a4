"""Listen where told: the coordinator's store listens on ``--host`` only (c10d's own server
takes every interface whatever host it is given), and its metrics on the same address by
default, moving to a free port, said in one line, when a second job on the machine holds it."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from liveshard.runtime.commands.coordinator import serve_metrics
from liveshard.runtime.control.metrics import JobMetrics
from liveshard.runtime.control.store import connect_store, serve_store
from liveshard.runtime.errors import ConfigError


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket tables")
def test_the_store_listens_on_its_host_only_and_serves_there():
    store = serve_store("127.0.0.1", 0, timeout=5.0)
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or ::
    store.set("k", "v")
    assert connect_store("127.0.0.1", store.port, timeout=5.0).get("k") == b"v"
    with pytest.raises(ConfigError, match=r"--port: cannot listen on 127.0.0.1:\d+: address already in use"):
        serve_store("127.0.0.1", store.port, timeout=5.0)


def test_metrics_on_a_taken_port_move_to_a_free_one_and_say_so(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = JobMetrics("job")
        with caplog.at_level(logging.WARNING, logger="liveshard.coordinator"):
            assert serve_metrics(metrics, port, "127.0.0.1") is metrics
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(f"metrics: port {port} is in use; serving on 127.0.0.1:")
        moved = int(lines[0].rsplit(":", 1)[1].split()[0])
        assert moved != port and "0100007F" in _listening_addresses(moved)
