"""The tests' view of cossd.harness.netns (two network namespaces joined by a veth pair): its names, and the `netns_pair` fixture."""
from __future__ import annotations

from typing import Iterator

import pytest

from cossd.harness.netns import (PREFIX, SUBNET, Netns, NetnsPair, clean_leftovers, joined_namespaces, namespaces,
                                 unavailable)

__all__ = ["PREFIX", "SUBNET", "Netns", "NetnsPair", "clean_leftovers", "joined_namespaces", "namespaces",
           "unavailable", "netns_pair"]


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two joined namespaces for one test, torn down after it even when it fails. Skips where
    network namespaces cannot be made (not root, no iproute2, no kernel support)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with joined_namespaces() as pair:
        yield pair
