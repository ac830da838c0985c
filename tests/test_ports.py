"""Free ports are picked from FEDERATION_PORT_RANGE: the suite's workers each pick from a slice of
their own (tests/conftest.py), so that two cannot take the same port between a pick and a bind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.processes import (
    DEFAULT_PORT_RANGE,
    PORT_RANGE_ENV,
    PROJECT_ROOT,
    PortRangeError,
    free_port_block,
    port_range,
)


def test_this_worker_picks_from_its_own_slice() -> None:
    low, high = port_range()
    assert DEFAULT_PORT_RANGE[0] <= low < high <= DEFAULT_PORT_RANGE[1]
    if "PYTEST_XDIST_WORKER" in os.environ and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        assert (low, high) != DEFAULT_PORT_RANGE
    for _ in range(50):
        first = free_port_block(3)
        assert low <= first and first + 2 <= high


def test_no_range_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "")
    assert port_range() == DEFAULT_PORT_RANGE


@pytest.mark.parametrize("value", ["junk", "30000-20000", "80-90", "20000-70000", "20000"])
def test_a_range_that_makes_no_sense_is_refused_with_its_value(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """In the code, and by fedctl before it starts anything: exit 2, one line, no traceback."""
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(PortRangeError, match=PORT_RANGE_ENV):
        port_range()
    done = subprocess.run(
        [sys.executable, "-m", "federation.cli", "status"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and repr(value) in done.stderr, done.stderr
