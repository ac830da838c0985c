"""Each component's timing constants in one frozen object (as aiohttp's `ClientTimeout`).

The values are the defaults DESIGN.md's budgets were measured with; the config file may
override any of them (`timings: {scheduler: {...}, agent: {...}, gateway: {...}}`), and
`fedctl up` hands each process its section as `--timings JSON`. Unknown names and values that
are not positive are refused with the field's name (pydantic validates them). The math of the
capacity estimator (its time constants) stays with the math in `scheduler/capacity.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Annotated, TypeVar

import pydantic
from pydantic import ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass

Seconds = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]  # no "5" for 5, no true for 1
Count = Annotated[int, Strict(), Field(ge=1)]
Rate = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]  # a number per second
_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, slots=True, config=_STRICT)
class SchedulerTimings:
    report_interval_s: Seconds = 0.25  # agents report this often (told them when they register) ...
    # ... unless the replica's sites would then send more than this many reports a second in all:
    # then each site that registers is told a longer interval (its heartbeat timeout grows with
    # it). A report costs a replica ~0.17 ms of CPU, so at a thousand sites reports every 0.25 s
    # would take most of a core (docs/BENCHMARKS.md, "The control plane at scale").
    reports_per_s: Rate = 2500.0
    heartbeat_timeout_s: Seconds = 1.0  # a site silent this long is down (DESIGN: down within 1 s)
    expiry_check_s: Seconds = 0.1  # sites' silence is checked this often
    stall_tolerance_s: Seconds = 0.25  # a check later than this says the scheduler, not the site, was silent
    in_transit_limit_s: Seconds = 300.0  # a routed request never seen at its site is forgotten after this
    shutdown_grace_s: Seconds = 2.0  # in-flight RPCs get this long at shutdown
    # Late checks skipped in a row (each trusting no silence: the reports may wait unread), at
    # most; after these, whatever still has not reported is down however late the check.
    max_skipped_checks: Count = 10


@dataclass(frozen=True, slots=True, config=_STRICT)
class AgentTimings:
    coalesce_s: Seconds = 0.1  # a stream's tokens wait at most this long to share a message (--coalesce-ms)
    health_interval_s: Seconds = 1.0  # each worker is checked this often
    health_timeout_s: Seconds = 5.0  # SGLang's /health runs a 1-token generation: slow under load, not dead
    connect_timeout_s: Seconds = 5.0  # a worker that does not accept a connection in this long is unreachable
    # A worker call with no first event in this long has failed: an Offline run can queue a
    # request behind thousands, so a first token may take many minutes. Once tokens flow, a
    # worker silent for between_events_timeout_s is broken, not busy.
    first_token_timeout_s: Seconds = 1800.0
    between_events_timeout_s: Seconds = 60.0  # and one silent this long between events
    call_check_s: Seconds = 1.0  # how often the worker calls' waits are checked
    abort_timeout_s: Seconds = 5.0  # an /abort_request that takes longer is given up
    probe_timeout_s: Seconds = 120.0  # a worker too slow to finish the calibration probe is left out
    reconnect_base_s: Seconds = 0.2  # the reporter's first wait before registering again
    reconnect_max_s: Seconds = 1.0  # and its longest: a site back from a partition rejoins within it
    register_timeout_s: Seconds = 5.0
    loop_tick_s: Seconds = 0.05  # the agent's loop hands its load to the reporter this often (lost workers too)
    late_report_s: Seconds = 0.75  # a gap this long between reports is logged (the heartbeat is 1 s)
    loop_stall_limit_s: Seconds = 5.0  # a loop silent this long is stuck: the reporter stops, the site goes down
    scheduler_ping_s: Seconds = 1.0  # a ping a scheduler leaves unanswered this long: its link is dead (> round trip)
    shutdown_grace_s: Seconds = 2.0  # in-flight RPCs get this long at shutdown
    # Launched workers (--launch): a dead one starts again after restart_base_s, doubling while
    # it dies before coming up, to restart_max_s; at shutdown each gets worker_stop_s to exit.
    restart_base_s: Seconds = 1.0
    restart_max_s: Seconds = 60.0
    worker_stop_s: Seconds = 10.0
    # A request whose worker never answered is tried on this many in all, each worker it tried
    # marked unhealthy until its health check passes.
    connect_attempts: Count = 3
    failures_to_unhealthy: Count = 2  # health checks missed in a row: one is noise, two a sick worker
    reporter_stop_s: Seconds = 5.0  # the reporter process is given this long to exit
    # Reader processes (--readers): each writes at least every reader_beat_s, and one silent for
    # reader_silent_s is hung and killed; one that died starts again after reader_restart_s,
    # doubling while it cannot be started, to reader_restart_max_s; at shutdown each gets
    # reader_stop_s to exit.
    reader_beat_s: Seconds = 1.0
    reader_silent_s: Seconds = 10.0
    reader_restart_s: Seconds = 0.5
    reader_restart_max_s: Seconds = 30.0
    reader_stop_s: Seconds = 10.0

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> AgentTimings:
        if self.reader_silent_s <= 2 * self.reader_beat_s:
            raise ValueError("reader_silent_s must exceed two reader_beat_s (a reader late by one beat is not hung)")
        if self.reader_restart_max_s < self.reader_restart_s or self.restart_max_s < self.restart_base_s:
            raise ValueError("a restart's longest wait must be at least its first")
        return self


@dataclass(frozen=True, slots=True, config=_STRICT)
class GatewayTimings:
    route_timeout_s: Seconds = 10.0  # one Route attempt (a burst keeps this loop busy for seconds)
    route_budget_s: Seconds = 30.0  # rounds of attempts, with jitter, for up to this long
    state_push_s: Seconds = 0.1  # the replicas push their state this often
    watch_silence_s: Seconds = 1.0  # a watched replica silent this long is cut off (dropped packets)
    loop_stall_s: Seconds = 0.25  # a wait ending this late means this loop stalled, not the replica
    watch_retry_s: Seconds = 0.2  # after losing every replica, they are tried again this often
    state_timeout_s: Seconds = 2.0  # one GetState
    scheduler_ping_s: Seconds = 1.0  # a ping a scheduler leaves unanswered this long: its link is dead (> round trip)
    retry_budget_s: Seconds = 30.0  # a request is retried (or resumed) on other sites for up to this long
    first_chunk_timeout_s: Seconds = 1900.0  # a site stream with no first chunk in this long has failed
    between_chunks_timeout_s: Seconds = 90.0  # and one silent this long between chunks
    stream_check_s: Seconds = 1.0  # how often the site streams' waits are checked
    circuit_failures: Count = 3  # a site that failed this many requests in a row (in this process) ...
    circuit_open_s: Seconds = 5.0  # ... gets none for this long, then one trial
    hold_check_s: Seconds = 0.1  # with no new state, the hold queue's head is weighed this often
    shutdown_grace_s: Seconds = 5.0  # open streams get this long at shutdown (fedctl waits 10 s)


@dataclass(frozen=True, slots=True, config=_STRICT)
class Timings:
    """The config file's `timings:` section: each component's, every field optional."""

    scheduler: SchedulerTimings = Field(default_factory=SchedulerTimings)
    agent: AgentTimings = Field(default_factory=AgentTimings)
    gateway: GatewayTimings = Field(default_factory=GatewayTimings)


T = TypeVar("T")


def from_json(kind: type[T], text: str) -> T:
    """A component's timings from `--timings JSON`; ValueError naming the bad field."""
    try:
        return kind(**json.loads(text))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"a JSON object of {kind.__name__} fields is needed: {exc}") from None
    except pydantic.ValidationError as exc:
        raise ValueError(describe(exc, kind.__name__)) from None


def add_timings_argument(parser: argparse.ArgumentParser, kind: type) -> None:
    """A process's `--timings JSON` (its component's defaults when absent); a wrong one is an
    argparse error naming the field."""

    def parse(text: str) -> object:
        try:
            return from_json(kind, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--timings", type=parse, default=kind(), help=f"JSON: {kind.__name__} fields to override (core/settings.py)"
    )


def to_json(timings: object) -> str:
    return json.dumps(dataclasses.asdict(timings))  # type: ignore[call-overload]


def describe(exc: pydantic.ValidationError, source: str) -> str:
    """One line naming each field that is wrong as the file spells it (`sites[0].gpus: ...`)."""
    problems = []
    for error in exc.errors(include_url=False):
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return f"{source}: " + "; ".join(problems)
