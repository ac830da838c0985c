"""Processes that use gRPC and then start children: grpc-core's fork handlers stay off.

When a process that uses grpc-core (1.85) forks, its fork handlers restart the event engine's
poller in the child, where `subprocess` has already closed every descriptor it does not pass
on, the poller's epoll one included; the child then aborts before it can exec (grpc/grpc#43055).
Seen here as a gateway started by the tests dying with SIGABRT at start, once in a few hundred
starts. Nothing of ours uses gRPC across a fork (every child execs at once), so the handlers
are not needed. grpc-core reads the variable when grpc is imported: call this before that.
"""

from __future__ import annotations

import os


def keep_grpc_out_of_forks() -> None:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
