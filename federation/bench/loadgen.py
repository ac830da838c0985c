"""`fedctl bench --loadgen {offline,server}`: MLPerf's own LoadGen drives the endpoint and gives the verdict.

Why: our own bench times requests itself; an MLPerf claim needs LoadGen's schedule (one
coalesced query in Offline, Poisson arrivals in Server), its sample order and its
VALID/INVALID verdict, read from the log files it writes — not our re-implementation.
The settings are MLPerf's for gpt-oss-120b (LoadGen's built-in mlperf.conf: token
latencies, p99 TTFT 3,000 ms and TPOT 80 ms, its seeds, the whole sample set issued in
shuffled permutations), changed only where the emulation needs it.

Time: emulated GPUs run at `speed` times the real ones' pace (10: ten times faster; 0.25:
four times slower), and LoadGen knows only wall clock. So what goes in is scaled to wall clock — limits and durations ÷ speed, QPS ×
speed — and what comes out is scaled back to GPU time: tokens/s ÷ speed, latencies ×
speed. (`fedctl bench` slows its federation's WAN links by the same factor; an endpoint
whose round trips are not scaled has them multiplied by `speed` in the TTFT reported.)

Threads: LoadGen calls `issue` on its own thread; that hands each batch to an asyncio
loop on a second thread, which owns the HTTP session and sends each sample with
`client.send`. The loop reports the first token and the completion back to LoadGen
(both calls are thread-safe and release the GIL). Every issued sample is completed to
LoadGen exactly once, failed ones with 0 tokens, so a broken endpoint ends the run
instead of hanging it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlperf_loadgen as lg
import structlog
import uvloop

from federation.bench import client
from federation.bench.workload import Sample

log = structlog.get_logger("bench.loadgen")

MLPERF_MODEL = "gpt-oss-120b"  # the benchmark whose settings LoadGen's built-in mlperf.conf holds
SCENARIOS = {"offline": lg.TestScenario.Offline, "server": lg.TestScenario.Server}
# Offline issues every sample at once and each open stream holds a socket. This machine's
# per-process file-descriptor limit is 20,000; 18,000 streams leave 2,000 for LoadGen's log
# files, Python and the rest. Samples past the cap wait in a queue, in issue order.
MAX_IN_FLIGHT = 18_000
SETUP_TIMEOUT_S = 60.0  # to list the endpoint's model before LoadGen starts
JOIN_POLL_S = 0.5  # the main thread wakes this often while LoadGen runs, so Ctrl-C is seen
NS_PER_MS = 1e6


@dataclass(slots=True)
class _Open:
    """One issued sample until it is completed to LoadGen."""

    query_id: int
    # LoadGen copies this buffer only into an accuracy log, which PerformanceOnly does not
    # write; the client sees text, not token ids, so it holds the sample's index. It lives
    # as long as this object, i.e. past the completion call.
    data: array
    first_sent: bool = False

    def response(self, *n_tokens: int) -> lg.QuerySampleResponse:
        addr, n = self.data.buffer_info()
        return lg.QuerySampleResponse(self.query_id, addr, n * self.data.itemsize, *n_tokens)


class _Sut:
    """The system under test as LoadGen sees it: an OpenAI-compatible endpoint behind an asyncio loop."""

    def __init__(self, endpoint: str, samples: list[Sample]) -> None:
        self.endpoint = endpoint
        self.samples = samples
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="loadgen-http", daemon=True)
        self.queue: collections.deque[tuple[_Open, Sample]] = collections.deque()
        self.tasks: dict[asyncio.Task[tuple[int, str | None]], _Open] = {}
        self.completed = 0
        self.failed = 0
        self.first_error: str | None = None
        self.aborting = False
        self.abandoned = False  # a second Ctrl-C left LoadGen running: leave the loop to it
        self._http: client.Session | None = None
        self._model = ""

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self.loop).result(SETUP_TIMEOUT_S)

    def stop(self) -> None:
        if self._http is not None:
            asyncio.run_coroutine_threadsafe(self._http.close(), self.loop).result(SETUP_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def abort(self) -> None:
        """Fail everything queued or in flight, and everything issued from now on (Ctrl-C)."""
        self.loop.call_soon_threadsafe(self._abort)

    async def _open(self) -> None:
        self._http = client.session()
        self._model = await client.served_model(self._http, self.endpoint)

    # LoadGen's thread ------------------------------------------------------------------

    def issue(self, query_samples: list[lg.QuerySample]) -> None:
        batch = [(_Open(q.id, array("q", [q.index])), self.samples[q.index]) for q in query_samples]
        self.loop.call_soon_threadsafe(self._admit, batch)

    def flush(self) -> None:
        pass  # nothing is held back: every sample is sent as soon as a slot is free

    # the loop's thread ----------------------------------------------------------------

    def _admit(self, batch: list[tuple[_Open, Sample]]) -> None:
        self.queue.extend(batch)
        self._start_queued()

    def _start_queued(self) -> None:
        while self.queue and (self.aborting or len(self.tasks) < MAX_IN_FLIGHT):
            sample_open, sample = self.queue.popleft()
            if self.aborting:
                self._complete(sample_open, 0, "aborted")
                continue
            task = self.loop.create_task(self._answer(sample_open, sample))
            self.tasks[task] = sample_open
            task.add_done_callback(self._done)

    async def _answer(self, sample_open: _Open, sample: Sample) -> tuple[int, str | None]:
        """Output tokens and error of one request; `client.send` reports the endpoint's failures."""
        assert self._http is not None

        def first_token() -> None:
            sample_open.first_sent = True
            lg.FirstTokenComplete([sample_open.response()])

        result = await client.send(self._http, self.endpoint, self._model, sample, on_first_token=first_token)
        return (result.output_tokens, None) if result.ok else (0, result.error)

    def _done(self, task: asyncio.Task[tuple[int, str | None]]) -> None:
        """Completes the sample however its task ended, even cancelled before it ran."""
        sample_open = self.tasks.pop(task)
        if task.cancelled():
            tokens, error = 0, "cancelled"
        elif (exc := task.exception()) is not None:
            tokens, error = 0, f"{type(exc).__name__}: {exc}"  # a bug or a malformed event
        else:
            tokens, error = task.result()
        self._complete(sample_open, tokens, error)
        self._start_queued()

    def _abort(self) -> None:
        self.aborting = True
        for task in self.tasks:
            task.cancel()
        self._start_queued()

    def _complete(self, sample_open: _Open, tokens: int, error: str | None) -> None:
        if not sample_open.first_sent:
            # LoadGen computes every sample's TPOT from its first-token time (reading past its
            # vector if there is none), so a sample that failed before its first token gets one now.
            lg.FirstTokenComplete([sample_open.response()])
        lg.QuerySamplesComplete([sample_open.response(tokens)])
        if error is None:
            self.completed += 1
            return
        self.failed += 1
        if self.first_error is None:
            self.first_error = error
            log.warning("loadgen.sample_failed", error=error, note="further failures are counted, not logged")


def _settings(scenario: str, target_qps: float, speed: float, min_duration_s: float, n_samples: int) -> lg.TestSettings:
    """MLPerf's gpt-oss-120b settings from LoadGen's built-in mlperf.conf, scaled to wall clock."""
    s = lg.TestSettings()
    if s.FromConfig("", MLPERF_MODEL, scenario.capitalize(), 0) != 0:
        raise RuntimeError(f"LoadGen has no built-in settings for {MLPERF_MODEL} {scenario}")
    s.scenario = SCENARIOS[scenario]
    s.mode = lg.TestMode.PerformanceOnly
    s.use_token_latencies = True
    s.ttft_latency = round(s.ttft_latency / speed)  # ns: 3,000 ms of GPU time in the conf
    s.tpot_latency = round(s.tpot_latency / speed)  # ns: 80 ms
    s.min_duration_ms = round(min_duration_s * 1000 / speed)
    # Our QSL is the performance set, whatever its size (the conf says 6,396), and each of
    # its samples is issued at least once, as MLPerf issues the whole set.
    s.performance_sample_count_override = 0
    s.accuracy_sample_count_override = 0
    s.min_query_count = n_samples
    s.server_target_qps = target_qps * speed
    s.offline_expected_qps = target_qps * speed
    return s


def run_loadgen(
    endpoint: str,
    samples: list[Sample],
    *,
    scenario: str,
    target_qps: float,
    speed: float,
    min_duration_s: float,
    log_dir: Path,
) -> dict[str, Any]:
    """Run one LoadGen PerformanceOnly test against `endpoint` (ending in /v1) and return its verdict.

    Inputs are in GPU time: `target_qps` (Server: the Poisson arrival rate; Offline: the
    expected rate, which sizes the one coalesced query as 1.1 × min duration × QPS, rounded
    up to whole permutations of `samples`) and `min_duration_s` (MLPerf's is 600 s).

    Returned: "loadgen_result" is LoadGen's VALID/INVALID; "output_tokens_per_s" is
    LoadGen's tokens/s (Offline: all output tokens ÷ the last completion; Server: completed
    tokens/s) divided by `speed`, i.e. GPU time; "ttft_p99_ms" and "tpot_p99_ms" are
    LoadGen's p99s multiplied by `speed` (Server only: LoadGen reports none in Offline, so
    they are None there); "completed_samples" are answered in full, "failed_samples" are
    completed to LoadGen with 0 tokens; "summary" holds the `key : value` lines of
    mlperf_log_summary.txt as LoadGen wrote them, in wall clock.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    if not samples:
        raise ValueError("no samples")
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = _settings(scenario, target_qps, speed, min_duration_s, len(samples))
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(log_dir)
    log_settings.enable_trace = False  # a trace event per sample and token: large, and unused

    sut = _Sut(endpoint, samples)
    try:
        sut.start()
        _run_test(sut, len(samples), settings, log_settings)
    finally:
        if not sut.abandoned:
            sut.stop()
    if sut.failed:
        log.warning("loadgen.failures", failed=sut.failed, completed=sut.completed, first_error=sut.first_error)

    detail = _detail(log_dir / "mlperf_log_detail.txt")
    if scenario == "offline":
        wall_tok_s = detail["result_tokens_per_second"]
        ttft_ns = tpot_ns = None
    else:
        wall_tok_s = detail["result_completed_tokens_per_second"]
        ttft_ns = detail["result_first_token_99.00_percentile_latency_ns"]
        tpot_ns = detail["result_time_per_output_token_99.00_percentile_ns"]
    return {
        "loadgen_scenario": scenario,
        "loadgen_result": detail["result_validity"],
        "loadgen_target_qps": target_qps,
        "output_tokens_per_s": wall_tok_s / speed,
        "ttft_p99_ms": None if ttft_ns is None else ttft_ns * speed / NS_PER_MS,
        "tpot_p99_ms": None if tpot_ns is None else tpot_ns * speed / NS_PER_MS,
        "completed_samples": sut.completed,
        "failed_samples": sut.failed,
        "log_dir": str(log_dir),
        "summary": _summary(log_dir / "mlperf_log_summary.txt"),
    }


def _run_test(sut: _Sut, n_samples: int, settings: lg.TestSettings, log_settings: lg.LogSettings) -> None:
    """StartTest blocks in C++, where Python never sees Ctrl-C; so it runs on a thread of its own.
    A first Ctrl-C fails the outstanding samples so LoadGen finishes (a Server run still waits
    out its schedule), then is raised; a second one leaves LoadGen's threads to the process exit."""
    lg_sut = lg.ConstructSUT(sut.issue, sut.flush)
    lg_qsl = lg.ConstructQSL(n_samples, n_samples, _in_memory, _in_memory)
    # Waited for with an Event: a Thread.join() cut short by Ctrl-C leaves is_alive() False
    # while the thread still runs (CPython 3.11), and freeing LoadGen's objects then crashes.
    done = threading.Event()

    def start_test() -> None:
        try:
            lg.StartTestWithLogSettings(lg_sut, lg_qsl, settings, log_settings)
        finally:
            done.set()

    threading.Thread(target=start_test, name="loadgen", daemon=True).start()
    try:
        while not done.wait(JOIN_POLL_S):
            pass
    except KeyboardInterrupt:
        log.warning("loadgen.interrupted", note="failing the outstanding samples; Ctrl-C again to leave now")
        sut.abort()
        try:
            while not done.wait(JOIN_POLL_S):
                pass
        except KeyboardInterrupt:
            sut.abandoned = True  # LoadGen still runs: nothing it uses may be freed
            raise
        raise
    finally:
        if done.is_set():
            lg.DestroyQSL(lg_qsl)
            lg.DestroySUT(lg_sut)


def _in_memory(_: list[int]) -> None:
    """The QSL's load/unload: the prompts are in memory already."""


def _detail(path: Path) -> dict[str, Any]:
    """The `:::MLLOG {json}` records of mlperf_log_detail.txt, by key (the last one wins)."""
    records: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        if line.startswith(":::MLLOG "):
            record = json.loads(line[len(":::MLLOG ") :])
            records[record["key"]] = record["value"]
    return records


def _summary(path: Path) -> dict[str, str | int | float]:
    """`key : value` lines of mlperf_log_summary.txt; numbers parsed, the rest kept as text."""
    out: dict[str, str | int | float] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value or key.startswith(("*", "WARNING")):
            continue
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out
