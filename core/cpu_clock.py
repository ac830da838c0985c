"""A process's CPU time for its /metrics: its event loop's thread apart from the whole process.

A Python event loop runs on one core. At SGLang's per-token pace a site's agent relays every token
of every worker of the site in its one loop (docs/DATAPATH.md, "How far one process goes"): an
agent whose loop thread spends ~1 CPU-second a second is the site's ceiling, whatever its GPUs could
give, and a gateway process there needs others beside it (`gateway: {processes: N}`). The loop's
thread is counted apart because gRPC's own threads run beside it on other cores: the process's
total may pass one core while its loop still has room.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LOOP, PROCESS = "loop", "process"  # the `part` label's values


class CpuClock:
    """The CPU seconds of the thread that made it (the loop's) and of the whole process, readable
    from any thread."""

    def __init__(self) -> None:
        self._loop = time.pthread_getcpuclockid(threading.get_ident())

    def seconds(self) -> dict[str, float]:
        return {LOOP: time.clock_gettime(self._loop), PROCESS: time.process_time()}


class CpuCollector(Collector):
    """`{name}_total{part="loop"|"process"}`, read when scraped. Register it from the loop's thread."""

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self._name, self._labels, self._clock = name, labels, CpuClock()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            self._name,
            "CPU seconds of this process: part=loop (its event loop's thread, which runs on one core) or "
            "process (every thread).",
            labels=[*self._labels, "part"],
        )
        for part, seconds in self._clock.seconds().items():
            family.add_metric([*self._labels.values(), part], seconds)
        yield family
