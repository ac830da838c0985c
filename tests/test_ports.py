"""Free ports are picked from FEDERATION_PORT_RANGE: the suite's workers each pick from a slice of
their own (tests/conftest.py), so that two cannot take the same port between a pick and a bind."""

from __future__ import annotations

import os

import pytest

from core.processes import DEFAULT_PORT_RANGE, PORT_RANGE_ENV, free_port_block, port_range


def test_this_worker_picks_from_its_own_slice() -> None:
    low, high = port_range()
    assert DEFAULT_PORT_RANGE[0] <= low < high <= DEFAULT_PORT_RANGE[1]
    if "PYTEST_XDIST_WORKER" in os.environ and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        assert (low, high) != DEFAULT_PORT_RANGE
    for _ in range(50):
        first = free_port_block(3)
        assert low <= first and first + 2 <= high


@pytest.mark.parametrize("value", ["", "junk", "30000-20000", "80-90", "20000-70000"])
def test_a_range_that_makes_no_sense_is_the_default(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    assert port_range() == DEFAULT_PORT_RANGE
