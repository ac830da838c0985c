"""One frozen Config for a federation, from a YAML file or the built-in default.

The default is DESIGN.md's embedded federation: two scheduler replicas and the gateway in
us-west-2, 16 emulated MI300X in Korea and 16 emulated MI355X in Oregon, ~130 ms apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from core.policy import POLICIES

CONFIG_ENV = "FEDERATION_CONFIG"  # a YAML file used when --config is not given
JOIN_TOKEN_ENV = "FEDERATION_JOIN_TOKEN"  # the credential a site presents to join (schedulers and agents)

DEFAULT_YAML = """\
model: openai/gpt-oss-120b
host: 127.0.0.1
speed: 1.0
gateway: {port: 8080, region: us-west-2}
scheduler: {port: 50051, region: us-west-2, replicas: 2}
links:
  - {between: [ap-northeast-2, us-west-2], rtt_ms: 130}
  - {between: [eu-central-1, us-west-2], rtt_ms: 150}
  - {between: [ap-northeast-2, eu-central-1], rtt_ms: 230}
sites:
  - {name: kr-mi300x, region: ap-northeast-2, gpu: mi300x, gpus: 16, agent_port: 50061}
  - {name: us-mi355x, region: us-west-2, gpu: mi355x, gpus: 16, agent_port: 50062}
"""

GPUS = ("mi300x", "mi355x")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SiteConfig:
    name: str
    region: str
    gpu: str
    gpus: int
    agent_port: int
    worker_port: int | None = None  # first port of the emulated workers; None: any free block


@dataclass(frozen=True, slots=True)
class Config:
    model: str
    host: str
    speed: float
    gateway_port: int
    gateway_region: str
    scheduler_port: int  # the first replica's; replica i listens on scheduler_port + i
    scheduler_region: str
    policy: str = "least_expected_delay"
    # Emulated workers send a stream event every this many decode steps (SGLang's
    # --stream-interval; 1, its default, is an event per token). A larger one is coarser
    # chunking than a real site's, and any result measured with it must say so.
    stream_interval: int = 1
    # Gateway processes sharing the port (SO_REUSEPORT): each open request holds a socket,
    # and one process has 20,000 file descriptors here; a federation at MLPerf load has more.
    gateway_processes: int = 1
    ttft_budget_ms: float = 0.0  # gateway latency mode when > 0 (see federation/gateway/admission.py)
    rtt_ms: dict[tuple[str, str], float] = field(default_factory=dict)  # both orders present
    sites: tuple[SiteConfig, ...] = ()
    scheduler_replicas: int = 1  # active-active: any of them can decide, agents report to all

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        return tuple(f"{self.host}:{self.scheduler_port + i}" for i in range(self.scheduler_replicas))

    def rtt_between(self, a: str, b: str) -> float:
        """The round trip between two regions; ConfigError when `links` does not say it (a
        missing link is a typo far more often than a 0-ms ocean)."""
        if a == b:
            return 0.0
        try:
            return self.rtt_ms[(a, b)]
        except KeyError:
            raise ConfigError(f"no `links` entry between {a} and {b}: say its rtt_ms") from None

    def with_overrides(
        self,
        *,
        port: int | None = None,
        speed: float | None = None,
        policy: str | None = None,
        stream_interval: int | None = None,
    ) -> Config:
        return replace(
            self,
            gateway_port=self.gateway_port if port is None else port,
            speed=self.speed if speed is None else speed,
            policy=self.policy if policy is None else policy,
            stream_interval=self.stream_interval if stream_interval is None else stream_interval,
        )


def _need(d: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}: `{key}` must be a {kind.__name__}, got {value!r}")
    return value


def _port(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{where}: ports must be integers in 1..65535, got {value!r}")


def parse(text: str, source: str = "config") -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    gateway = raw.get("gateway") or {}
    scheduler = raw.get("scheduler") or {}
    for name, section in (("gateway", gateway), ("scheduler", scheduler)):
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: `{name}` must be a mapping like {{port: 8080, region: us-west-2}}")
        _port(section.get("port", 1), f"{source}: {name}")
    policy = scheduler.get("policy", "least_expected_delay")
    if policy not in POLICIES:
        raise ConfigError(f"{source}: scheduler.policy must be one of {', '.join(sorted(POLICIES))}")
    rtt: dict[tuple[str, str], float] = {}
    for i, link in enumerate(raw.get("links") or []):
        between = link.get("between") if isinstance(link, dict) else None
        if not (isinstance(between, list) and len(between) == 2 and all(isinstance(r, str) for r in between)):
            raise ConfigError(f"{source}: links[{i}].between must name two regions")
        ms = link.get("rtt_ms")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or ms < 0:
            raise ConfigError(f"{source}: links[{i}].rtt_ms must be a number >= 0")
        a, b = between
        rtt[(a, b)] = rtt[(b, a)] = float(ms)
    sites = []
    for i, s in enumerate(raw.get("sites") or []):
        where = f"{source}: sites[{i}]"
        if not isinstance(s, dict):
            raise ConfigError(f"{where} must be a mapping")
        site = SiteConfig(
            _need(s, "name", str, where),
            _need(s, "region", str, where),
            _need(s, "gpu", str, where),
            _need(s, "gpus", int, where),
            _need(s, "agent_port", int, where),
            _need(s, "worker_port", int, where) if "worker_port" in s else None,
        )
        if site.gpu not in GPUS:
            raise ConfigError(f"{where}: gpu must be one of {', '.join(GPUS)}")
        if site.gpus < 1:
            raise ConfigError(f"{where}: gpus must be >= 1")
        _port(site.agent_port, where)
        if site.worker_port is not None:
            _port(site.worker_port + site.gpus - 1, where)
        sites.append(site)
    if not sites:
        raise ConfigError(f"{source}: at least one site is needed")
    processes = _need(gateway, "processes", int, f"{source}: gateway") if "processes" in gateway else 1
    replicas = _need(scheduler, "replicas", int, f"{source}: scheduler") if "replicas" in scheduler else 1
    if replicas < 1:
        raise ConfigError(f"{source}: scheduler.replicas must be >= 1")
    _port(scheduler.get("port", 50051) + replicas - 1, f"{source}: scheduler (the last replica)")
    budget = gateway.get("ttft_budget_ms", 0.0)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget < 0:
        raise ConfigError(f"{source}: gateway.ttft_budget_ms must be a number >= 0")
    if processes < 1:
        raise ConfigError(f"{source}: gateway.processes must be >= 1")
    if len({s.name for s in sites}) != len(sites):
        raise ConfigError(f"{source}: site names must be unique")
    speed, interval = raw.get("speed", 1.0), raw.get("stream_interval", 1)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or speed <= 0:
        raise ConfigError(f"{source}: speed must be a number > 0")
    if "stream_chunk_ms" in raw:
        raise ConfigError(
            f"{source}: stream_chunk_ms is gone: emulated workers stream as SGLang does, an event every "
            "`stream_interval` decode steps (1, the default, is an event per token)"
        )
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"{source}: stream_interval must be an integer >= 1")
    config = Config(
        model=str(raw.get("model", "openai/gpt-oss-120b")),
        host=str(raw.get("host", "127.0.0.1")),
        speed=float(speed),
        gateway_port=int(gateway.get("port", 8080)),
        gateway_region=str(gateway.get("region", "")),
        scheduler_port=int(scheduler.get("port", 50051)),
        scheduler_region=str(scheduler.get("region", gateway.get("region", ""))),
        policy=policy,
        stream_interval=interval,
        gateway_processes=processes,
        ttft_budget_ms=float(budget),
        rtt_ms=rtt,
        sites=tuple(sites),
        scheduler_replicas=replicas,
    )
    try:
        for site in config.sites:
            config.rtt_between(site.region, config.gateway_region)
            config.rtt_between(site.region, config.scheduler_region)
        config.rtt_between(config.gateway_region, config.scheduler_region)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _check_ports(config, source)
    return config


def _check_ports(config: Config, source: str) -> None:
    """Two listeners on one port fail only at start-up, half-started; say it when the file is read."""
    owners: dict[int, str] = {}

    def claim(port: int, owner: str) -> None:
        if port in owners:
            raise ConfigError(f"{source}: port {port} is both {owners[port]}'s and {owner}'s")
        owners[port] = owner

    claim(config.gateway_port, "the gateway")
    for i in range(config.scheduler_replicas):
        claim(config.scheduler_port + i, f"scheduler replica {i}")
    for site in config.sites:
        claim(site.agent_port, f"{site.name}'s agent")
        if site.worker_port is not None:
            for gpu in range(site.gpus):
                claim(site.worker_port + gpu, f"{site.name}'s worker {gpu}")


def load(path: Path | None = None) -> Config:
    """The config at `path`, else at $FEDERATION_CONFIG, else the built-in default."""
    path = path or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    if path is None:
        return parse(DEFAULT_YAML, "built-in default")
    try:
        return parse(path.read_text(), str(path))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
