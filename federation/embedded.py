"""The embedded federation's processes on this machine: started in order, stopped together.

`fedctl up` serves with it until Ctrl-C; `fedctl bench` starts one per run (`running`).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import grpc
import yaml

from core import credential, deployment, wire
from core.config import Config, ConfigError, SiteConfig
from core.mtls import INSECURE, INSECURE_WARNING, Tls
from core.pki import GATEWAY, SCHEDULER, Identity, Role
from core.processes import Child, StartFailed, spawn_python, wait_ready
from federation import control
from federation.admin import fetch_state
from federation.gateway import metrics
from federation.throwaway_ca import ThrowawayCa

READY_WAIT_S = 60.0  # sites must report ready within this long after their agents start


class Federation:
    """The processes of one federation on this machine, started in dependency order, speaking
    mutual TLS under a CA made for the run (`insecure`: plaintext, sites joining with a join
    credential instead)."""

    def __init__(
        self,
        config: Config,
        log: IO[str] | None = None,
        *,
        scheduler_links: bool = False,
        insecure: bool = False,
        join_token: str = "",
        faults: bool = False,
        launch: bool = False,
        load_s: float = 0.0,
    ) -> None:
        if config.across_machines or config.tls is not None:
            raise ConfigError(
                "this config places processes on machines of their own (scheduler.addresses, sites[].address) or "
                "names their certificates (tls): start each process with --config (docs/OPERATING.md); "
                "fedctl up runs one machine's federation under a CA of its own"
            )
        self.config = _pinging_past_the_links(config)
        self.log = log  # where the processes' log lines go (default: our stderr)
        # Every path to a scheduler replica through a link of ours, its region's round trip or
        # 0 ms (a drill can then drop a replica's packets for everyone: scheduler-blackhole).
        self.scheduler_links = scheduler_links
        self.faults = faults  # the emulated workers serve their drill faults (/_emulator/faults, die)
        # The sites' agents start their workers as a real site's do (`--launch emulator`: one
        # process per worker, from the recipes, each taking `load_s` to load), rather than one
        # emulator process per site (`--emulate`: the benches' and drills' economy).
        self.launch = launch
        self.load_s = load_s
        self._recipes_file: Path | None = None
        self.children: list[Child] = []
        # Where `fedctl` commands on this machine find the operator's certificate.
        self.ca = None if insecure else ThrowawayCa(control.tls_dir(self.config), self.config.host)
        self.operator: Tls = self.ca.operator if self.ca else INSECURE
        # Plaintext: the credential its sites join with (the operator's, or one made for this
        # run), in a file only its user reads, so no process that was not given it can join.
        self.join_token_file: Path | None = None
        if self.ca is None:
            self.join_token_file = control.join_token_path(self.config)
            credential.write_secret(self.join_token_file, join_token or secrets.token_urlsafe(24))
        self._metrics_dir = ""  # the gateway processes' shared counters, when there are several

    def tls_flags(self, identity: Identity) -> list[str]:
        """What a process of this federation serving or calling as `identity` is started with."""
        return self.ca.flags(identity) if self.ca else ["--insecure"]

    def child(self, name: str) -> Child:
        """The process started as `name` ("scheduler 0", "agent kr-mi300x", "gateway", ...)."""
        return next(c for c in self.children if c.name == name)

    def _start(
        self,
        name: str,
        module: str,
        args: list[str],
        env: dict[str, str] | None = None,
        as_: Identity | None = None,
        wait: bool = True,
    ) -> Child:
        """Start a process; `as_`: the identity it serves and calls as (a WAN link has none).
        Without `wait` it is returned before its ready line (for `wait_ready`)."""
        if as_ is not None:
            args = [*args, *self.tls_flags(as_)]
            if self.join_token_file is not None and as_.role in (Role.SCHEDULER, Role.SITE):
                args += ["--join-token-file", str(self.join_token_file)]
        child = spawn_python(name, module, args, log=self.log, env=env)
        self.children.append(child)
        return wait_ready(child) if wait else child

    def _link(self, name: str, target_port: int, rtt_ms: float) -> str:
        """A WAN link in user space; returns the address to dial instead of the target."""
        host = self.config.host
        child = self._start(
            name,
            "federation.linkproxy",
            ["--listen", f"{host}:0", "--target", f"{host}:{target_port}", "--rtt-ms", str(rtt_ms)],
        )
        return str(child.ready["listen"])

    def up(self) -> None:
        c = self.config
        if self.ca is None:
            print(f"fedctl: {INSECURE_WARNING}", file=self.log or sys.stderr, flush=True)
        schedulers = [
            self._start(f"scheduler {i}", "scheduler", self._scheduler_args(i), as_=SCHEDULER, wait=False)
            for i in range(c.scheduler.replicas)
        ]
        for child in schedulers:
            wait_ready(child)
        # The sites and the gateway start side by side: a site is ready once its workers answer,
        # its probe ran and it registered (seconds each), and the gateway needs only the schedulers.
        starting = [self._start_site(site, wait=False) for site in c.sites]
        gateway_args = deployment.gateway_args(c, self._to_schedulers("gateway", c.gateway.region))
        shared, env = [], {}
        if c.gateway.processes > 1:  # one port, and one /metrics for all of them
            self._metrics_dir = tempfile.mkdtemp(prefix="federation-gateway-metrics-")
            shared, env = ["--reuse-port"], {metrics.MULTIPROCESS_DIR_ENV: self._metrics_dir}
        for i in range(c.gateway.processes):
            name = f"gateway {i}" if shared else "gateway"
            starting.append(self._start(name, "federation.gateway", [*gateway_args, *shared], env, GATEWAY, False))
        for child in starting:
            wait_ready(child)
        self._wait_sites_ready({s.name for s in c.sites})

    def restart_scheduler(self, replica: int) -> None:
        """Kill one scheduler replica and start it again, empty: its state comes back from the
        sites' registrations and reports."""
        name = f"scheduler {replica}"
        old = self.child(name)
        old.proc.kill()
        old.proc.wait()
        self.children.remove(old)
        self._start(name, "scheduler", self._scheduler_args(replica), as_=SCHEDULER)

    def _scheduler_args(self, replica: int) -> list[str]:
        return deployment.scheduler_args(self.config, replica)

    def _to_schedulers(self, client: str, region: str) -> list[str]:
        """The addresses `client` (in `region`) dials for each replica: across a WAN link
        "link CLIENT->scheduler I" when its region is another, or when every path has one."""
        c = self.config
        rtt = c.control_rtt_between(region, c.scheduler_region)
        if not (rtt or self.scheduler_links):
            return list(c.scheduler_addresses)
        return [
            self._link(f"link {client}->scheduler {i}", c.scheduler.port + i, rtt) for i in range(c.scheduler.replicas)
        ]

    def links_to_scheduler(self, replica: int) -> list[Child]:
        """Every link carrying calls to one replica (see `_to_schedulers`)."""
        return [c for c in self.children if c.name.startswith("link ") and c.name.endswith(f"->scheduler {replica}")]

    def _start_site(self, site: SiteConfig, wait: bool = True) -> Child:
        """A site's agent (with its emulated workers) and, for a remote region, its WAN links;
        without `wait`, the agent is returned before its ready line."""
        c = self.config
        to_schedulers, advertise = self._to_schedulers(site.name, site.region), f"{c.host}:{site.agent_port}"
        rtt = c.rtt_between(site.region, c.gateway.region)
        if rtt:
            advertise = self._link(f"link gateway->{site.name}", site.agent_port, rtt)
        emulation = [
            *self._workers_args(),
            *("--speed", str(c.speed), "--emulator-stream-interval", str(c.stream_interval)),
            *(["--emulator-port", str(site.worker_port)] if site.worker_port else []),
            *(["--emulator-enable-faults"] if self.faults else []),
        ]
        return self._start(
            f"agent {site.name}",
            "nodes.agent",
            [*deployment.agent_args(c, dataclasses.replace(site, workers=None), to_schedulers, advertise), *emulation],
            as_=Identity(Role.SITE, site.name),
            wait=wait,
        )

    def _workers_args(self) -> list[str]:
        """How an agent gets its emulated workers, from the config's recipes."""
        if self._recipes_file is None:
            self._recipes_file = Path(tempfile.mkdtemp(prefix="federation-recipes-")) / "recipes.yaml"
            recipes = {gpu: r.model_dump(mode="json") for gpu, r in self.config.recipes.items()}
            self._recipes_file.write_text(yaml.safe_dump({"recipes": recipes}))
        how = ["--launch", "emulator", "--emulator-load-s", str(self.load_s)] if self.launch else ["--emulate"]
        return [*how, "--recipes", str(self._recipes_file)]

    def add_site(self, site: SiteConfig) -> None:
        """A new site joins the running federation (`fedctl site add --emulate`); returns once
        every scheduler replica has it ready (it then earns its share by slow start)."""
        if any(s.name == site.name for s in self.config.sites):
            raise ValueError(f"a site named {site.name!r} is already in this federation")
        self.config.rtt_between(site.region, self.config.gateway.region)  # ConfigError before anything starts
        self.config.rtt_between(site.region, self.config.scheduler_region)
        self.config = dataclasses.replace(self.config, sites=(*self.config.sites, site))
        started = len(self.children)
        self._start_site(site)
        self._wait_sites_ready({site.name}, started)

    def remove_site(self, name: str) -> list[str]:
        """Stop a site's processes (its agent, whose workers die with it, and its WAN links) once
        the schedulers have forgotten it (`fedctl site remove`); returns what was stopped."""
        if not any(s.name == name for s in self.config.sites):
            raise ValueError(f"no site named {name!r} was started here")
        own = [*(c for c in self.children if c.name == f"agent {name}"), *self.links_of(name)]
        for child in own:
            child.stop()
            self.children.remove(child)
        self.config = dataclasses.replace(self.config, sites=tuple(s for s in self.config.sites if s.name != name))
        return [c.name for c in own]

    def links_of(self, site: str) -> list[Child]:
        """The site's WAN links, as `_start_site` names them: "link SITE->scheduler I" (its
        reports) and "link gateway->SITE" (the gateway's streams)."""
        return [c for c in self.children if c.name.startswith(f"link {site}->") or c.name == f"link gateway->{site}"]

    def _wait_sites_ready(self, wanted: set[str], started: int = 0) -> None:
        """These sites ready at every scheduler replica (while none of the processes started
        from `self.children[started]` on has exited)."""
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            try:
                everywhere = [
                    {s.name for s in fetch_state(address, self.operator).sites if s.status is wire.SiteStatus.READY}
                    for address in self.config.scheduler_addresses
                ]
            except grpc.RpcError:
                everywhere = [set()]
            if all(wanted <= ready for ready in everywhere):
                return
            dead = [c.name for c in self.children[started:] if not c.alive()]
            if dead:
                raise StartFailed(f"{', '.join(dead)} exited during start-up")
            time.sleep(0.2)
        raise StartFailed(f"sites not ready within {READY_WAIT_S:.0f} s: {sorted(wanted)}")

    def down(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self._metrics_dir:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        if self._recipes_file is not None:
            shutil.rmtree(self._recipes_file.parent, ignore_errors=True)
        if self.ca is not None:
            self.ca.remove()
        if self.join_token_file is not None:
            self.join_token_file.unlink(missing_ok=True)


@contextmanager
def running(config: Config, log: IO[str] | None = None, *, insecure: bool = False) -> Iterator[str]:
    """A started federation's endpoint (…/v1); every process stops when the block ends."""
    federation = Federation(config, log, insecure=insecure)
    try:
        federation.up()
        yield config.gateway_url + "/v1"
    finally:
        federation.down()


def _pinging_past_the_links(config: Config) -> Config:
    """A ping to a scheduler must outlive the round trip to it, or every ping on a long link
    fails a healthy connection: the agents' and the gateway's ping timeouts are raised to a
    second more than the longest control link's round trip, where the config's are shorter."""
    longest_s = max((config.control_rtt_between(a, b) for a, b in config.rtt_ms), default=0.0) / 1000
    if not longest_s:
        return config
    timings = config.timings
    agent = dataclasses.replace(timings.agent, scheduler_ping_s=max(timings.agent.scheduler_ping_s, 1.0 + longest_s))
    gateway = dataclasses.replace(
        timings.gateway, scheduler_ping_s=max(timings.gateway.scheduler_ping_s, 1.0 + longest_s)
    )
    return dataclasses.replace(config, timings=dataclasses.replace(timings, agent=agent, gateway=gateway))
