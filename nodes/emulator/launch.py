"""Start an emulator process from other programs (agents, benchmarks, tests) on free ports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO

from core.processes import PROJECT_ROOT, Child, free_port_block, start_python

__all__ = ["PROJECT_ROOT", "EmulatorProcess", "free_port_block", "launch"]


class EmulatorProcess(Child):
    @property
    def urls(self) -> list[str]:
        return self.ready["urls"]


def launch(
    args: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    wrapper: Sequence[str] = (),
    log: IO[str] | None = None,
) -> EmulatorProcess:
    """Run `python -m nodes.emulator ARGS --host HOST --port PORT` (a free block unless given)
    and wait until it is ready."""
    workers = int(args[list(args).index("--workers") + 1]) if "--workers" in args else 1
    port = port or free_port_block(workers, host)
    child = start_python("emulator", "nodes.emulator", [*args, "--port", str(port), "--host", host], wrapper=wrapper)
    return EmulatorProcess(child.name, child.proc, child.ready)
