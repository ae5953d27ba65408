"""tests/helpers.py's free_ports: the one place the tests take loopback ports from."""
from __future__ import annotations

import socket

from helpers import free_port, free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    """Ports probed together differ (a server's several listeners, a rank's MASTER_PORT beside
    a metrics port), and each can be listened on once handed out."""
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 <= port < 65536 for port in ports)
    listeners = [socket.socket() for _ in ports]
    try:
        for listener, port in zip(listeners, ports):
            listener.bind(("127.0.0.1", port))
            listener.listen()
        assert 1024 <= free_port() < 65536 and free_port() not in ports
    finally:
        for listener in listeners:
            listener.close()
