"""`fedctl bench --loadgen`: MLPerf's LoadGen drives a small real federation and gives its verdict."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from core.config import parse
from core.processes import free_port_block
from federation.bench import client, loadgen
from federation.bench.loadgen import run_loadgen
from federation.bench.workload import LengthDistribution, WorkloadSpec
from federation.embedded import Federation

SPEED = 10.0  # emulated GPUs 10x faster than real ones
GPUS = 2  # per site: 4 emulated GPUs in all, small enough for a shared 2-core machine
SAMPLES = 40
# Short answers after short prompts: the whole Offline run is a second or two of wall clock.
SHORT = WorkloadSpec(SAMPLES, seed=1, prompt=LengthDistribution(64, 0.3, 16, 256), output=LengthDistribution(64, 0.3))
# Answers that take several seconds of wall clock: a run that is still going when interrupted.
LONG = replace(SHORT, output=LengthDistribution(4000, 0.1))
TOO_LONG_PROMPT = " hello" * 140_000  # ~140 k tokens, past the 131,072-token context: the endpoint refuses it


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two sites of two emulated GPUs each, in one region (no WAN link processes)."""
    sites = "\n".join(
        f"  - {{name: {name}, region: us-west-2, gpu: {gpu}, gpus: {GPUS}, agent_port: {free_port_block(1)}, "
        f"worker_port: {free_port_block(GPUS)}}}"
        for name, gpu in (("us-mi300x", "mi300x"), ("us-mi355x", "mi355x"))
    )
    config = parse(
        f"speed: {SPEED}\n"
        f"gateway: {{port: {free_port_block(1)}, region: us-west-2}}\n"
        f"scheduler: {{port: {free_port_block(1)}, region: us-west-2}}\n"
        f"sites:\n{sites}\n"
    )
    with (tmp_path_factory.mktemp("federation") / "processes.log").open("w") as log:
        federation = Federation(config, log=log)
        try:
            federation.up()
            yield config.gateway_url + "/v1"
        finally:
            federation.down()


@pytest.mark.timeout(60)
def test_offline_run_completes_every_sample_and_reports_the_verdict(endpoint: str, tmp_path: Path) -> None:
    """LoadGen's Offline query reaches the federation; every sample is answered in full, and the
    verdict, tokens/s and summary come from LoadGen's own log files."""
    result = run_loadgen(
        endpoint,
        SHORT.samples(),
        scenario="offline",
        target_qps=5.0,  # 1.1 x 2 s x 5/s = 11 samples, rounded up to one permutation of the 40
        speed=SPEED,
        min_duration_s=2.0,
        log_dir=tmp_path,
    )
    assert (result["completed_samples"], result["failed_samples"]) == (SAMPLES, 0)
    assert result["loadgen_scenario"] == "offline"
    assert result["loadgen_result"] in ("VALID", "INVALID")
    assert result["summary"]["Result is"] == result["loadgen_result"]
    assert result["summary"]["Scenario"] == "Offline"
    # LoadGen's wall-clock tokens/s, in GPU time: ÷ speed.
    assert result["output_tokens_per_s"] == pytest.approx(result["summary"]["Tokens per second"] / SPEED)
    assert result["output_tokens_per_s"] > 0
    assert result["ttft_p99_ms"] is None and result["tpot_p99_ms"] is None  # LoadGen reports none in Offline
    assert (tmp_path / "mlperf_log_summary.txt").exists() and result["log_dir"] == str(tmp_path)


@pytest.mark.timeout(60)
def test_server_run_reports_token_latencies_in_gpu_time(endpoint: str, tmp_path: Path) -> None:
    """In Server, LoadGen's p99 TTFT and TPOT come back multiplied by the speed (GPU time), and
    the limits it was given were divided by it."""
    result = run_loadgen(
        endpoint,
        SHORT.samples(),
        scenario="server",
        target_qps=2.0,  # 20/s of wall clock: the 40 samples arrive over ~2 s
        speed=SPEED,
        min_duration_s=2.0,
        log_dir=tmp_path,
    )
    assert (result["completed_samples"], result["failed_samples"]) == (SAMPLES, 0)
    summary = result["summary"]
    assert summary["Scenario"] == "Server"
    assert summary["ttft_latency (ns)"] == 3_000_000_000 / SPEED and summary["tpot_latency (ns)"] == 80_000_000 / SPEED
    ttft_ns, tpot_ns = (
        summary["99.00 percentile first token latency (ns)"],
        summary["99.00 percentile time to output token (ns)"],
    )
    assert result["ttft_p99_ms"] == pytest.approx(ttft_ns * SPEED / 1e6) and result["ttft_p99_ms"] > 0
    assert result["tpot_p99_ms"] == pytest.approx(tpot_ns * SPEED / 1e6) and result["tpot_p99_ms"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(summary["Completed tokens per second"] / SPEED)
    # 40 queries are far too few for LoadGen's early-stopping estimate of a p99.
    assert result["loadgen_result"] == "INVALID" and summary["Early stopping satisfied"] == "NO"


@pytest.mark.timeout(60)
def test_failed_requests_are_completed_with_zero_tokens(endpoint: str, tmp_path: Path) -> None:
    """Samples the endpoint refuses are still completed to LoadGen, so the run ends, and are counted."""
    samples = SHORT.samples()
    for i in (3, 17):
        samples[i] = replace(samples[i], prompt=TOO_LONG_PROMPT)
    result = run_loadgen(
        endpoint,
        samples,
        scenario="offline",
        target_qps=5.0,
        speed=SPEED,
        min_duration_s=2.0,
        log_dir=tmp_path,
    )
    assert (result["completed_samples"], result["failed_samples"]) == (SAMPLES - 2, 2)
    assert result["output_tokens_per_s"] > 0
    # The tokens LoadGen counted (its tokens/s x samples / samples/s, over the same time) leave out the refused two.
    counted = result["summary"]["Tokens per second"] * SAMPLES / result["summary"]["Samples per second"]
    assert counted == pytest.approx(sum(s.output_tokens for i, s in enumerate(samples) if i not in (3, 17)), abs=1)


@pytest.mark.timeout(60)
def test_offline_queue_keeps_at_most_the_cap_in_flight(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline issues every sample at once; no more than MAX_IN_FLIGHT reach the endpoint together,
    and the queued rest are all sent and completed."""
    cap, in_flight, peak = 5, 0, 0
    real_send = client.send

    async def counting_send(*args, **kwargs) -> client.Result:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await real_send(*args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(loadgen, "MAX_IN_FLIGHT", cap)
    monkeypatch.setattr(client, "send", counting_send)
    result = run_loadgen(
        endpoint, SHORT.samples(), scenario="offline", target_qps=5.0, speed=SPEED, min_duration_s=2.0, log_dir=tmp_path
    )
    assert (result["completed_samples"], result["failed_samples"]) == (SAMPLES, 0)
    assert peak == cap


@pytest.mark.timeout(60)
def test_ctrl_c_fails_the_outstanding_samples_and_ends_the_run(endpoint: str, tmp_path: Path) -> None:
    """Ctrl-C during a run cancels the open requests, completes them to LoadGen so it finishes and
    writes its logs, and is then raised; the endpoint serves the next run as before."""
    ctrl_c = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_loadgen(
                endpoint, LONG.samples(), scenario="offline", target_qps=5.0, speed=SPEED, min_duration_s=2.0,
                log_dir=tmp_path / "interrupted",
            )  # fmt: skip
    finally:
        ctrl_c.cancel()  # a run that ended before it must not interrupt pytest itself
    assert time.monotonic() - started < 5.0
    assert "Result is" in (tmp_path / "interrupted" / "mlperf_log_summary.txt").read_text()
    result = run_loadgen(
        endpoint, SHORT.samples(), scenario="offline", target_qps=5.0, speed=SPEED, min_duration_s=2.0,
        log_dir=tmp_path / "after",
    )  # fmt: skip
    assert (result["completed_samples"], result["failed_samples"]) == (SAMPLES, 0)
