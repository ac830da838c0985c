"""Joining a federation: a site whose workers serve another model or tokenizer, or (in a
plaintext federation) that does not present the join credential, is refused with the reason,
never becomes a site (so no request is routed to it), and `fedctl status` tells the operator
why. An agent started without schedulers joins when `fedctl site add --agent` names them, and
only an operator may tell it to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import openai
import psutil
import pytest

from core import wire
from core.credential import write_secret
from core.pki import Identity, Role
from core.processes import PROJECT_ROOT, Child, free_port_block, start_python
from federation import admin
from federation.admin import fetch_state
from federation.drills.faults import poll_until
from federation.embedded import Federation
from nodes.emulator.launch import launch
from tests.conftest import fedctl

NEWCOMER = "eu-mi355x"


def _status(path: Path, *flags: str) -> subprocess.CompletedProcess:
    return fedctl("status", "--config", str(path), *flags, timeout_s=30)


def _agent(fed: Federation, *workers: str, port: int = 0, join: bool = True, credential: Path | None = None) -> Child:
    """A newcomer's agent, started by hand as an operator would, with its site's certificate
    from the federation's CA (plaintext with `credential` in an --insecure one), pointed at
    the schedulers (or, without `join`, waiting to be told them)."""
    schedulers = [arg for address in fed.config.scheduler_addresses for arg in ("--scheduler", address)]
    args = ["--site", NEWCOMER, "--region", "eu-central-1", "--gpu", "mi355x", "--gpus", "1"]
    args += ["--port", str(port or free_port_block(1)), *(schedulers if join else []), *workers]
    args += fed.tls_flags(Identity(Role.SITE, NEWCOMER))
    args += ["--join-token-file", str(credential)] if credential else []
    return start_python(f"agent {NEWCOMER}", "nodes.agent", args)


def _refused_for(fed: Federation, path: Path, *workers: str, credential: Path | None = None, why: str = "") -> str:
    """Starts the newcomer, waits until `fedctl status` lists it as refused (`why` in the
    reason); the status text."""
    agent = _agent(fed, *workers, credential=credential)
    flags = () if fed.ca else ("--insecure",)
    try:

        def refused() -> bool:  # asked in-process: a `fedctl status` is a process start
            refusals = fetch_state(fed.config.scheduler_addresses[0], fed.operator).refused
            return any(r.name == NEWCOMER and why in r.reason for r in refusals)

        assert poll_until(refused, 15.0) is not None
        status = _status(path, *flags).stdout
    finally:
        agent.stop(10)
    site_names = [line.split()[0] for line in status.splitlines()[1:] if not line.startswith(("refused", "schedulers"))]
    assert NEWCOMER not in site_names, status  # never a site: nothing can be routed to it
    return status


@pytest.mark.timeout(120)
def test_a_site_without_the_credential_is_refused_by_a_plaintext_federation(make_federation, tmp_path: Path) -> None:
    """--insecure: no certificates, so the join credential is the check, read from a file only
    its user may read (never the environment). An agent with a wrong one gets UNAUTHENTICATED
    and is shown as refused; one whose file others may read does not start."""
    fed, path = make_federation(insecure=True)
    assert fed.join_token_file is not None and fed.join_token_file.stat().st_mode & 0o777 == 0o600
    wrong = tmp_path / "wrong-token"
    write_secret(wrong, "not-the-credential")
    status = _refused_for(fed, path, "--emulate", "--speed", "10", credential=wrong)
    assert "did not present this federation's join credential" in status
    wrong.chmod(0o644)
    args = ["--site", NEWCOMER, "--region", "eu-central-1", "--gpu", "mi355x", "--gpus", "1", "--emulate"]
    started = subprocess.run(
        [sys.executable, "-m", "nodes.agent", *args, "--insecure", "--join-token-file", str(wrong)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROJECT_ROOT,
    )
    assert started.returncode == 2 and "readable by others (mode 644); chmod 600 it" in started.stderr


@pytest.mark.timeout(120)
def test_a_site_serving_another_model_is_refused(shared_federation) -> None:
    """Workers that serve another model: the agent registers what they serve, and is refused."""
    fed, path = shared_federation
    why = "serves 'someone/other-model', but this federation serves 'openai/gpt-oss-120b'"
    status = _refused_for(fed, path, "--emulate", "--speed", "10", "--model", "someone/other-model", why=why)
    assert why in status


@pytest.mark.timeout(120)
def test_a_site_with_another_tokenizer_or_an_unknown_checkpoint_is_refused(shared_federation) -> None:
    """The same model name over workers that tokenize differently is refused too; so are
    workers that load a checkpoint the federation does not know as its model (the checkpoints
    of its recipes, in their weight formats, are; the schedulers' --checkpoint adds others)."""
    fed, path = shared_federation
    model = fed.config.model
    cases = (
        (["--tokenizer-path", "someone/tok"], "tokenizes with 'someone/tok'"),
        (
            ["--model-path", "someone/gpt-oss-120b-int4", "--served-model-name", model, "--tokenizer-path", model],
            "loads checkpoint 'someone/gpt-oss-120b-int4', which this federation does not know as "
            "'openai/gpt-oss-120b' (known: lmsys/gpt-oss-120b-bf16, openai/gpt-oss-120b",
        ),
    )
    for flags, why in cases:
        workers = launch(["--profile", "mi355x", "--workers", "1", "--speed", "10", *flags])
        try:
            status = _refused_for(fed, path, "--worker-url", workers.urls[0], why=why)
        finally:
            workers.stop()
        assert why in status


def _add_agent(path: Path, port: int, gpus: int = 1) -> subprocess.CompletedProcess:
    site = ["--name", NEWCOMER, "--region", "eu-central-1", "--gpu", "mi355x", "--gpus", str(gpus)]
    return fedctl("site", "add", "--config", str(path), *site, "--agent", f"127.0.0.1:{port}")


@pytest.mark.timeout(150)
def test_an_agent_started_alone_joins_when_an_operator_adds_it(make_federation) -> None:
    """An agent started without schedulers waits. A Join from a gateway's certificate, or one
    naming another site, is refused with the reason and changes nothing; the operator's
    `fedctl site add --agent` makes the site ready at every replica and it serves the
    endpoint's requests (the others drained); adding it again is a no-op."""
    fed, path = make_federation()
    port = free_port_block(1)
    agent = _agent(fed, "--emulate", "--speed", "10", port=port, join=False)
    try:
        assert fed.ca is not None
        request = wire.JoinRequest(tuple(fed.config.scheduler_addresses), NEWCOMER, "eu-central-1", "mi355x", 1)
        gateway = fed.ca.tls(Identity(Role.GATEWAY))
        with gateway.sync_channel(f"127.0.0.1:{port}", Identity(Role.SITE, NEWCOMER)) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                wire.SiteAgentStub(channel).Join(wire.join_request_to_pb(request), timeout=10)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == "gateway may not call Join"
        other = _add_agent(path, port, gpus=2)
        assert other.returncode == 2, other.stderr
        assert "runs site 'eu-mi355x' (1 x mi355x in eu-central-1), not 'eu-mi355x' (2 x mi355x" in other.stderr
        assert NEWCOMER not in _status(path).stdout

        added = _add_agent(path, port)
        assert added.returncode == 0 and f"{NEWCOMER}: joined, agent at 127.0.0.1:{port}" in added.stdout, added.stderr
        for name in ("kr-mi300x", "us-mi355x"):
            assert fedctl("site", "drain", "--config", str(path), name).returncode == 0
        endpoint = fed.config.gateway_url + "/v1"
        with openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0) as client:
            raw = client.completions.with_raw_response.create(
                model=fed.config.model, prompt="Hello", max_tokens=20, extra_body={"ignore_eos": True}
            )
        assert raw.headers["x-federation-site"] == NEWCOMER and raw.parse().usage.completion_tokens == 20
        assert _add_agent(path, port).returncode == 0
    finally:
        agent.stop(10)


@pytest.mark.timeout(120)
def test_a_site_loading_its_model_is_joining_and_gets_no_traffic(make_federation) -> None:
    """An agent that launches its workers (`--launch emulator`: the recipe's command line, an
    emulated 5-s model load during which no worker port answers) registers at once: the site is
    `joining`, its worker loading, its weight format shown, and none of the requests sent
    meanwhile go to it. Once its worker is up and probed it is ready and serves. Started with
    `--first-gpu 3` (the host's GPUs 0-2 another site's), its worker is given GPU 3."""
    fed, path = make_federation()
    agent = _agent(fed, "--launch", "emulator", "--emulator-load-s", "5", "--speed", "10", "--first-gpu", "3")
    address = fed.config.scheduler_addresses[0]

    def newcomer() -> wire.SiteState | None:
        return next((s for s in fetch_state(address, fed.operator).sites if s.name == NEWCOMER), None)

    try:
        assert poll_until(lambda: newcomer() is not None, 10.0) is not None
        site = newcomer()
        assert site is not None and site.status is wire.SiteStatus.JOINING, site
        (worker,) = [p for p in psutil.Process(agent.pid).children() if "nodes.emulator" in p.cmdline()]
        assert worker.environ()["HIP_VISIBLE_DEVICES"] == "3"
        assert (site.healthy_workers, site.loading_workers, site.weight_format) == (0, 1, "mxfp4")
        row = next(line for line in _status(path).stdout.splitlines() if line.startswith(NEWCOMER))
        assert "joining" in row.split() and "mxfp4" in row.split(), row
        endpoint = fed.config.gateway_url + "/v1"
        with openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0) as client:
            sites = [
                client.completions.with_raw_response.create(model=fed.config.model, prompt="Hi", max_tokens=4).headers[
                    "x-federation-site"
                ]
                for _ in range(6)
            ]
            still = newcomer()
            assert NEWCOMER not in sites and still is not None and still.status is wire.SiteStatus.JOINING
            assert still.routed_requests == 0
            assert poll_until(lambda: newcomer().status is wire.SiteStatus.READY, 30.0) is not None
            ready = newcomer()
            assert ready is not None and (ready.healthy_workers, ready.loading_workers) == (1, 0)
            assert ready.capacity_evidence == "probe"  # registered again with what its probe measured
            for name in ("kr-mi300x", "us-mi355x"):  # in-process: `fedctl site drain` is tested where it is the point
                admin.drain(fed.config.scheduler_addresses, fed.operator, name)
            raw = client.completions.with_raw_response.create(model=fed.config.model, prompt="Hi", max_tokens=4)
        assert raw.headers["x-federation-site"] == NEWCOMER
    finally:
        agent.stop(10)


def test_first_gpu_is_refused_where_the_agent_launches_nothing() -> None:
    """`--first-gpu` says which of the host's GPUs launched workers take; with workers given by
    URL or emulated in one process it would mean nothing, so it is refused, with the reason."""
    args = ["--site", NEWCOMER, "--region", "eu-central-1", "--gpu", "mi355x", "--gpus", "1", "--insecure"]
    proc = subprocess.run(
        [sys.executable, "-m", "nodes.agent", *args, "--worker-url", "http://127.0.0.1:9", "--first-gpu", "2"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "--first-gpu needs --launch" in proc.stderr, proc.stderr
