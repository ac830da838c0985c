"""The peer `fedctl bench` measures beside the federation: the real sglang-router, flat over the same GPUs.

sglang-router knows no sites or regions: whoever runs it over two regions lists every worker URL
and it balances over all of them. So `FlatRouter` starts the same emulated workers our site
agents would run (profile, GPU count, speed, stream interval), runs the router where our gateway
runs, and puts each worker of a remote region behind the same user-space WAN link
(`federation/linkproxy.py`, one process per region) that our gateway crosses to reach that
site's agent: a request pays that round trip once either way.

The router (PyPI `sglang-router` 0.3.2, a Rust binary) is started with the flags below so that
it neither rejects nor evicts anything under benchmark load (~18 k open streams), and with no
way off this machine: it asks the hub for `model_path`'s tokenizer and only warns when that
fails. Two things it does differently from SGLang, which a client must allow for: it answers
422 to a `/v1/completions` prompt of token ids (it parses `prompt` as text or a list of texts;
sgl-project/sglang PR #35262), and it serves `/v1/models` as `text/plain`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import IO, Any

from core.config import Config, SiteConfig
from core.processes import PROJECT_ROOT, Child, StartFailed, free_port_block, start_python
from nodes.emulator.launch import launch

ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware")
READY_TIMEOUT_S = 60.0  # same bound as our own processes; the router itself is ready far sooner
POLL_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 2.0  # one GET to the router while it starts; it answers loopback calls in ms
LOG_TAIL_CHARS = 2000  # of the router's log, quoted when it fails to start
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log even into a file
# Descriptors the router holds besides its streams: listeners, its log, idle and load-polling
# connections to workers (15 with 2 workers, 20 with 4); generous for 32.
ROUTER_SPARE_FDS = 256
# Each open stream holds a client and a worker descriptor, and the router's HTTP client keeps
# finished requests' worker connections idle in its pool: an Offline run budgeted at two per
# stream ran out of descriptors, opened every circuit breaker and got thousands of "no available
# workers" answers (docs/BENCHMARKS.md, "Offline, 30,000 samples"). A third descriptor per
# stream leaves the pool room.
FDS_PER_STREAM = 3
# The router's Rust hub client reads HF_ENDPOINT (not HF_HUB_OFFLINE): pointed at a closed
# loopback port, its tokenizer download fails at once and never leaves the host.
ROUTER_ENV = {"HF_ENDPOINT": "http://127.0.0.1:1", "HF_HUB_OFFLINE": "1"}
# Caps sglang-router 0.3.2 has (`launch_router --help`) and what we set, for ~18 k open streams:
# - --max-concurrent-requests: a token bucket (default -1 = off in 0.3.2; the library docstring
#   says 256, so pin it); when on, --queue-size (100) and --queue-timeout-secs (60) hold the
#   excess, then 429 / 408, and --rate-limit-tokens-per-second defaults to the same cap.
# - --request-timeout-secs (1,800): one request, stream included; an Offline run's last answers
#   wait behind ~18 k others, which at speed 1 can take longer than that.
# - health checks (GET /health every 60 s, 5 s timeout, 3 failures evict): on SGLang 0.5.23, and
#   on our emulator, /health is a 1-token generation queued behind the batch, so a busy worker
#   fails it and is evicted. The benchmark injects no faults: no health checker at all.
# - --max-payload-size (512 MB): far above a ~1 k-token prompt. Retries (5, on 408/429/5xx) and the
#   circuit breaker (10 failures) stay at their defaults: they are the router's own behaviour.
# - no cap on connections to workers or from clients; the one limit is this process's open
#   files: each open stream holds two descriptors (client and worker), see `_raise_open_files`.
# Its HTTP client would also honour *_proxy variables: they are dropped, workers are on loopback.
ROUTER_FLAGS = (
    *("--max-concurrent-requests", "-1"),
    *("--request-timeout-secs", str(24 * 3600)),  # a day: longer than any benchmark run
    "--disable-health-check",
    *("--worker-startup-check-interval", "1"),  # default 30 s between probes of a worker not up yet
    *("--worker-startup-timeout-secs", str(int(READY_TIMEOUT_S))),
    *("--shutdown-grace-period-secs", "5"),  # default 180 s for in-flight streams; a stopped bench has none worth it
    *("--log-level", "warn"),  # info writes two lines per request: CPU the emulated GPUs need
)


class FlatRouter:
    """Workers, WAN links and the router for one config; `endpoint` is the router's /v1."""

    def __init__(
        self,
        config: Config,
        policy: str,
        *,
        log: IO[str] | None = None,
        worker_urls: dict[str, list[str]] | None = None,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        self.config = config
        self.policy = policy
        self.log = log  # where the workers' and links' log lines go (default: our stderr)
        # Each site's workers when they run already (a federation's, measured in the same run);
        # without it the router starts its own, as the sites' agents would.
        self.worker_urls = worker_urls
        self.endpoint = ""
        self.children: list[Child] = []
        self._router_log: IO[str] | None = None

    def __enter__(self) -> FlatRouter:
        try:
            urls = [url for site in self.config.sites for url in self._start_site(site)]
            base = self._start_router(urls)
            self._wait_serving(base, len(urls))
        except BaseException:
            self._stop()
            raise
        self.endpoint = base + "/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @property
    def max_open_streams(self) -> int:
        """Streams the router can hold open on this machine: FDS_PER_STREAM descriptors each under
        its hard open-files limit. Past it, connecting to a worker fails, its circuit
        breakers open and requests get 503 "no available workers": an artefact of the machine,
        not of the router, so a benchmark should offer the peer no more than this."""
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(0, (hard - ROUTER_SPARE_FDS) // FDS_PER_STREAM)

    def _start_site(self, site: SiteConfig) -> list[str]:
        """The site's emulated workers; the URLs the router dials, through a WAN link if remote."""
        c = self.config
        if self.worker_urls is not None:
            urls = self.worker_urls[site.name]
        else:
            args = ["--profile", site.gpu, "--workers", str(site.gpus), "--speed", str(c.speed)]
            args += ["--stream-interval", str(c.stream_interval), "--served-model-name", c.model]
            args += ["--enable-cache-report"]  # as the federation's workers: the client sees cached tokens
            workers = launch(args, host=c.host, log=self.log)
            self.children.append(workers)
            urls = workers.urls
        rtt_ms = c.rtt_between(site.region, c.gateway.region)
        if not rtt_ms:
            return urls
        first = free_port_block(len(urls), c.host)
        link_args = ["--rtt-ms", str(rtt_ms)]
        for i, url in enumerate(urls):
            link_args += ["--listen", f"{c.host}:{first + i}", "--target", url.removeprefix("http://")]
        self.children.append(start_python(f"link router->{site.name}", "federation.linkproxy", link_args, log=self.log))
        return [f"http://{c.host}:{first + i}" for i in range(len(urls))]

    def _start_router(self, worker_urls: list[str]) -> str:
        host = self.config.host
        port = free_port_block(2, host)  # the router's port, then its Prometheus port (29000 if not told)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls]
        cmd += ["--policy", self.policy, "--host", host, "--port", str(port)]
        cmd += ["--prometheus-host", host, "--prometheus-port", str(port + 1), *ROUTER_FLAGS]
        self._router_log = tempfile.TemporaryFile("w+")  # closed in _stop
        proc = subprocess.Popen(
            cmd,
            cwd=PROJECT_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._router_log,
            stderr=subprocess.STDOUT,
            env={**{k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}, **ROUTER_ENV},
        )
        self.children.append(Child("sglang-router", proc, {}))
        _raise_open_files(proc.pid)
        return f"http://{host}:{port}"

    def _wait_serving(self, base: str, workers: int) -> None:
        """Until /v1/models answers and /workers lists every worker healthy."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        seen = "nothing yet"
        while time.monotonic() < deadline:
            dead = [c.name for c in self.children if not c.alive()]
            if dead:
                raise StartFailed(f"{', '.join(dead)} exited during start-up{self._log_tail()}")
            models, listed = _get_json(base + "/v1/models"), _get_json(base + "/workers")
            if models is not None and listed is not None:
                healthy = sum(bool(w.get("is_healthy")) for w in listed.get("workers", ()))
                seen = f"{healthy} of {workers} workers healthy"
                if healthy == workers == len(listed["workers"]):
                    return
            time.sleep(POLL_INTERVAL_S)
        raise StartFailed(f"sglang-router not serving within {READY_TIMEOUT_S:.0f} s ({seen}){self._log_tail()}")

    def _log_tail(self) -> str:
        if self._router_log is None:
            return ""
        self._router_log.seek(0)
        tail = _ANSI_ESCAPE.sub("", self._router_log.read())[-LOG_TAIL_CHARS:].strip()
        return f"; router log ends:\n{tail}" if tail else ""

    def _stop(self) -> None:
        for child in reversed(self.children):  # router first, then links, then workers
            child.stop()
        self.children.clear()
        if self._router_log is not None:
            self._router_log.close()
            self._router_log = None


def _raise_open_files(pid: int) -> None:
    """The router holds two descriptors per open stream and, unlike our programs, does not raise
    its own soft limit (often 1,024); the hard limit still caps it (see `max_open_streams`)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass  # exited already: _wait_serving says so


def _get_json(url: str) -> Any:
    """The body of a 200 answer, else None (not listening yet, 503 while it has no worker)."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
            return json.load(resp) if resp.status == 200 else None
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None
