"""The tests' S3 server: harness/s3_server.py (SeaweedFS on loopback or in a network namespace), re-exported under its old name."""
from __future__ import annotations

from cossd.harness.s3_server import KEY, MISSING, SECRET, WEED, WeedServer, client, free_ports, start_weed

__all__ = ["KEY", "MISSING", "SECRET", "WEED", "WeedServer", "client", "free_ports", "start_weed"]
