"""The ports a local run chooses for its processes: free when chosen, and below the kernel's
ephemeral range, so that no outgoing connection takes one as its local port in the seconds
before its process binds it (two pooled runs starting together once lost a trainer that way)."""

from __future__ import annotations

import socket

import pytest

from rlctl.process import topology
from rlctl.process.topology import LOWEST_PORT, ephemeral_range, free_ports

pytestmark = pytest.mark.process


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    lo, _ = ephemeral_range()
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(LOWEST_PORT <= p < lo for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_without_room_below_the_range_the_kernel_picks(tmp_path, monkeypatch):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{LOWEST_PORT + 10}\t60999\n")
    monkeypatch.setattr(topology, "EPHEMERAL_RANGE", narrow)
    assert ephemeral_range() == (LOWEST_PORT + 10, 60999)
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p >= ephemeral_range()[0] for p in ports), ports
    monkeypatch.setattr(topology, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ephemeral_range() == (32768, 60999)
