"""Long-lived tasks never die silently (core.supervise): a loop that raises is logged with its
traceback and started again after a backoff; an essential task that raises stops its process
with exit code 1, the traceback logged; and each supervised task of ours holds its rule when
something raises inside it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import psutil
import pytest
from structlog.testing import capture_logs

from core import supervise, wire
from core.errors import FederationError, TooBusy
from core.processes import free_port_block
from core.settings import SchedulerTimings
from federation.drills.faults import poll_until
from federation.gateway import metrics as gateway_metrics
from federation.gateway.admission import Admission
from federation.gateway.schedulers import Schedulers
from federation.gateway.upstream import SiteStream, Upstream
from nodes.agent import __main__ as agent_main
from nodes.agent.pool import WorkerPool
from nodes.agent.service import SiteAgentService
from nodes.emulator.launch import launch
from scheduler.service import SchedulerService

SITE = "kr-mi300x"


async def test_a_loop_that_raises_is_logged_and_restarted_after_a_growing_backoff() -> None:
    """Raising twice, then running to its end: three runs, two tracebacks logged, the second
    restart after twice the first's backoff."""
    runs: list[float] = []

    async def flaky() -> None:
        runs.append(time.monotonic())
        if len(runs) <= 2:
            raise RuntimeError(f"bug {len(runs)}")

    with capture_logs() as logs:
        await asyncio.wait_for(supervise.restarting("flaky", flaky), 5)
    restarts = [e for e in logs if e["event"] == "task.restarting"]
    assert len(runs) == 3 and [e["task"] for e in restarts] == ["flaky", "flaky"]
    assert [e["after_s"] for e in restarts] == [supervise.RESTART_FIRST_S, 2 * supervise.RESTART_FIRST_S]
    assert all(e["exc_info"] is True for e in restarts)  # structlog renders the traceback
    assert runs[2] - runs[1] >= 2 * supervise.RESTART_FIRST_S * 0.9


async def test_an_essential_task_that_raises_fails_the_process_and_one_that_ends_does_not() -> None:
    supervisor = supervise.Supervisor()

    async def done() -> None:
        return None

    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("a bug")

    with capture_logs() as logs:
        await supervisor.essential("done", done())
        assert not supervisor.failed.is_set() and supervisor.exit_code == 0
        supervisor.essential("broken", broken())
        await asyncio.wait_for(supervisor.failed.wait(), 5)
        await supervisor.close()
    assert supervisor.exit_code == supervise.EXIT_FAILED
    failed = [e for e in logs if e["event"] == "task.failed"]
    assert len(failed) == 1 and failed[0]["task"] == "broken"
    assert isinstance(failed[0]["exc_info"][1], ValueError)


async def test_the_schedulers_expiry_sweep_that_raises_still_marks_a_silent_site_down(monkeypatch) -> None:
    """The sweep raises on its first check: it is logged, started again, and the site that
    stopped reporting is down within the heartbeat timeout and the backoff."""
    timings = SchedulerTimings()
    service = SchedulerService("m", {}, timings=timings)
    service.registry.register(wire.SiteRegistration(SITE, "r", "mi300x", 8, "kr:1", "m"))
    service.registry.apply_report(wire.SiteReport(SITE, healthy_workers=8, total_workers=8), time.monotonic())
    expire, calls = service.registry.expire, []

    def raising_once(now: float) -> list[str]:
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a bug in the sweep")
        return expire(now)

    monkeypatch.setattr(service.registry, "expire", raising_once)
    with capture_logs() as logs:
        task = service.start_expiry()
        try:
            limit_s = timings.heartbeat_timeout_s + supervise.RESTART_FIRST_S + 2.0
            for _ in range(round(limit_s / 0.05)):
                if service.registry.get(SITE).status is wire.SiteStatus.DOWN:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
    assert service.registry.get(SITE).status is wire.SiteStatus.DOWN
    assert [e["task"] for e in logs if e["event"] == "task.restarting"] == ["scheduler.expire"]


@pytest.mark.timeout(120)
def test_an_agent_whose_reporter_dies_logs_why_and_exits_non_zero(make_federation, capfd) -> None:
    """The process that sends the site's reports is killed: the agent cannot be seen as up, so
    it says which task failed, with the traceback, and exits 1 for its supervisor to restart."""
    fed, _ = make_federation()
    agent = fed.child(f"agent {SITE}")
    reporter = next(p for p in psutil.Process(agent.pid).children() if "spawn_main" in " ".join(p.cmdline()))
    reporter.send_signal(signal.SIGKILL)
    assert poll_until(lambda: agent.proc.poll() is not None, 30) is not None
    assert agent.proc.returncode == supervise.EXIT_FAILED
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    failed = [e for e in lines if e.get("event") == "task.failed"]
    assert failed and failed[0]["task"] == "agent.report", failed
    assert "ReporterDied" in json.dumps(failed[0]["exception"])


def _ignore(_stream: SiteStream, _delta: wire.TokenDelta) -> None:
    pass


@contextlib.asynccontextmanager
async def _agent_in_process() -> AsyncIterator[str]:
    """A real agent (not yet joined: no scheduler answers) over one emulated worker, served in
    this test's loop so that a test can make its parts raise; yields its address."""
    workers = launch(["--profile", "mi355x", "--workers", "1", "--speed", "20"])
    port = free_port_block(1)
    site = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "1", "--port", str(port)]
    nobody = f"127.0.0.1:{free_port_block(1)}"
    serving = asyncio.ensure_future(
        agent_main.serve(agent_main.parse_args([*site, "--scheduler", nobody, "--worker-url", workers.urls[0]]))
    )
    try:
        yield f"127.0.0.1:{port}"
        assert not serving.done(), serving.result()
    finally:
        serving.cancel()  # as a stop: the agent's server, tasks and sessions are closed in turn
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(serving, return_exceptions=True)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):  # its stop_event()'s, on this loop
                asyncio.get_running_loop().remove_signal_handler(sig)
            workers.stop()


async def _generate(upstream: Upstream, address: str, max_new_tokens: int = 4) -> BaseException | None:
    """One generation through the agent: None once answered, else what failed it."""
    request = wire.GenerateRequest(f"r{time.monotonic_ns()}", 4, {"max_new_tokens": max_new_tokens}, "hi")
    stream = upstream.start("s", address, request, _ignore)
    try:
        async with asyncio.timeout(10):
            await stream.done
        return None
    except (FederationError, asyncio.CancelledError) as exc:  # `done` is cancelled when `first` fails
        try:
            stream.first.result()
        except FederationError as first:
            return first
        return exc
    finally:
        stream.close()


@pytest.mark.timeout(120)
async def test_an_unexpected_error_in_a_generation_fails_it_at_once_as_the_sites(monkeypatch) -> None:
    """A bug inside the agent's generation (here its relay raises what no handler expects): the
    request ends within seconds with the site's failure, which the gateway resumes or retries
    elsewhere, instead of waiting out its 1,900-s deadline; the agent serves on."""

    async def broken(*_args, **_kwargs) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(SiteAgentService, "_relay", broken)
    upstream = Upstream()
    try:
        with capture_logs() as logs:
            async with _agent_in_process() as address:
                for _ in range(100):  # until the agent serves
                    failure = await _generate(upstream, address)
                    if failure is not None and "internal error" in str(failure):
                        break
                    await asyncio.sleep(0.1)
    finally:
        await upstream.close()
    assert failure is not None and "internal error (RuntimeError)" in str(failure), failure
    assert any(e["event"] == "generate.unexpected_error" for e in logs)


def _raising_once(real: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """`real`, except that its first run raises at once."""
    runs = 0

    async def run(*args: object) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("a bug")
        await real(*args)

    return run


@pytest.mark.timeout(120)
async def test_the_agents_worker_checks_and_call_watch_restart_after_raising(monkeypatch) -> None:
    """The loops that check the workers' health and bound each call's waits both raise on their
    first run: each is logged and started again, and the agent then serves (its worker found
    healthy by the restarted checks)."""
    monkeypatch.setattr(WorkerPool, "check_forever", _raising_once(WorkerPool.check_forever))
    monkeypatch.setattr(SiteAgentService, "watch_calls", _raising_once(SiteAgentService.watch_calls))
    upstream = Upstream()
    try:
        with capture_logs() as logs:
            async with _agent_in_process() as address:
                for _ in range(100):
                    failure = await _generate(upstream, address)
                    if failure is None:
                        break
                    await asyncio.sleep(0.1)
    finally:
        await upstream.close()
    assert failure is None, failure
    restarted = {e["task"] for e in logs if e["event"] == "task.restarting"}
    assert restarted == {"agent.check_workers", "agent.watch_calls"}, restarted


async def test_the_gateways_metrics_flush_restarts_after_raising() -> None:
    """The gateway's twice-a-second flush of its counters and gauges raises once (here reading
    whether it is degraded): it is logged, started again, and the gauge is written after all."""
    asked = 0

    def degraded() -> bool:
        nonlocal asked
        asked += 1
        if asked == 1:
            raise RuntimeError("a bug")
        return True

    with capture_logs() as logs:
        task = gateway_metrics.start_flushing(degraded, dict)
        try:
            for _ in range(100):
                if asked >= 2 and gateway_metrics.DEGRADED._value.get() == 1:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            gateway_metrics.DEGRADED.set(0)
    assert asked >= 2 and [e["task"] for e in logs if e["event"] == "task.restarting"] == ["gateway.metrics_flush"]


@pytest.mark.timeout(120)
async def test_the_gateways_hold_queue_pump_restarts_after_raising(make_federation, monkeypatch) -> None:
    """Latency mode's pump, which weighs the held requests at each state, raises on its first
    weighing: it is logged and started again, weighs the queue again, and the held request (a
    client 3 s away with a 1.5-s budget) is refused with 429 at its deadline, not left hanging."""
    fed, _ = make_federation(sites=[("us-mi355x", "us-west-2", "mi355x")], rtt_ms=3000, insecure=True)
    weighed = 0
    real = Schedulers.estimate

    def estimate(self: Schedulers, req: wire.RouteRequest) -> wire.RouteDecision | None:
        nonlocal weighed
        weighed += 1
        if weighed == 1:
            raise RuntimeError("a bug")
        return real(self, req)

    monkeypatch.setattr(Schedulers, "estimate", estimate)
    schedulers = Schedulers(list(fed.config.scheduler_addresses), rtt_s={("ap-northeast-2", "us-west-2"): 3.0})
    schedulers.start()
    try:
        for _ in range(100):  # the first state watched
            if schedulers.state is not None:
                break
            await asyncio.sleep(0.1)
        admission = Admission(schedulers, max_held=10)
        request = wire.RouteRequest("held", prompt_tokens=10, max_tokens=5, client_region="ap-northeast-2")
        with capture_logs() as logs:
            started = time.monotonic()
            with pytest.raises(TooBusy):
                await admission.route(request, budget=1.5)
            waited = time.monotonic() - started
    finally:
        await schedulers.close()
    assert weighed >= 2 and 1.0 <= waited <= 3.0, (weighed, waited)
    assert [e["task"] for e in logs if e["event"] == "task.restarting"] == ["gateway.admission"]


@pytest.mark.timeout(120)
async def test_a_launched_sites_join_probe_that_raises_stops_the_agent_with_exit_1(monkeypatch) -> None:
    """An agent whose launched worker loads: once it is up, the join probe runs, and here it
    raises. A site that never probed would stay `joining` for ever, so the agent says which task
    failed, with the traceback, and its serve ends with exit code 1 for its supervisor."""

    async def broken_probe(_pool: WorkerPool) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(agent_main.calibrate, "probe", broken_probe)
    port, nobody = free_port_block(1), f"127.0.0.1:{free_port_block(1)}"
    site = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "1", "--port", str(port)]
    launched = ["--launch", "emulator", "--emulator-load-s", "0.5", "--speed", "20"]
    args = agent_main.parse_args([*site, "--scheduler", nobody, *launched])
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(90):
                code = await agent_main.serve(args)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # its stop_event()'s, on this loop
            asyncio.get_running_loop().remove_signal_handler(sig)
    assert code == supervise.EXIT_FAILED
    failed = [e for e in logs if e["event"] == "task.failed"]
    assert [e["task"] for e in failed] == ["agent.probe_when_up"], failed
