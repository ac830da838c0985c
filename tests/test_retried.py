"""A retried call leaves nothing for the garbage collector (core/runtime.retried): a gateway
makes one or two per request, and tenacity's own cycles made its collections long pauses."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_none

from core import runtime


@pytest.fixture
def garbage() -> Iterator[list[object]]:
    """What the collector finds unreachable from here on, kept to be counted."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


RETRY_ON = retry_if_exception_type(ConnectionError)  # built once, as the gateway's: it refers to itself


def _retrying() -> AsyncRetrying:
    return AsyncRetrying(retry=RETRY_ON, wait=wait_none(), stop=stop_after_attempt(3), reraise=True)


async def test_a_call_retried_or_not_leaves_no_cycle_and_a_bare_call_does(garbage: list[object]) -> None:
    """100 calls that succeed at once and 100 that succeed on their second attempt: through
    `retried`, the collector finds nothing (a call that fails every attempt leaves its exception's
    traceback cycle, as any raised exception caught in a frame does: a failed request's, rare);
    tenacity's own call leaves its cycles (which is why `retried` exists: this fails if tenacity
    stops making them too)."""
    attempts = {"n": 0}

    async def flaky(fail_times: int) -> int:
        attempts["n"] += 1
        if attempts["n"] <= fail_times:
            raise ConnectionError("refused")
        return attempts["n"]

    for fail_times in (0, 1):
        for _ in range(100):
            attempts["n"] = 0
            assert await runtime.retried(_retrying(), flaky, fail_times) == fail_times + 1
    gc.collect()
    assert [type(o).__name__ for o in garbage] == []

    for _ in range(100):
        attempts["n"] = 0
        await _retrying()(flaky, 0)
    gc.collect()
    assert len(garbage) >= 100
