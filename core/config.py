"""One frozen Config for a federation, from a YAML file or the built-in default.

The default is DESIGN.md's embedded federation: two scheduler replicas and the gateway in
us-west-2, 16 emulated MI300X in Korea and 16 emulated MI355X in Oregon, ~130 ms apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import ConfigDict, Field, Strict, StrictBool, StrictStr

from core import runtime
from core.pki import Identity
from core.policy import POLICIES
from core.recipes import DEFAULT_RECIPES, Recipe, RecipeError
from core.settings import Timings, describe
from core.tiers import TierName

CONFIG_ENV = "FEDERATION_CONFIG"  # a YAML file used when --config is not given

DEFAULT_YAML = """\
model: openai/gpt-oss-120b
host: 127.0.0.1
speed: 1.0
gateway: {port: 8080, region: us-west-2}
scheduler: {port: 50051, region: us-west-2, replicas: 2, metrics_port: 9451}
links:
  - {between: [ap-northeast-2, us-west-2], rtt_ms: 130}
  - {between: [eu-central-1, us-west-2], rtt_ms: 150}
  - {between: [ap-northeast-2, eu-central-1], rtt_ms: 230}
sites:
  - {name: kr-mi300x, region: ap-northeast-2, gpu: mi300x, gpus: 16, agent_port: 50061, metrics_port: 9461}
  - {name: us-mi355x, region: us-west-2, gpu: mi355x, gpus: 16, agent_port: 50062, metrics_port: 9462}
"""

GpuName = Literal["mi300x", "mi355x"]


class ConfigError(ValueError):
    pass


# How a site's agent gets its workers when started from the file (`python -m nodes.agent --config`):
# launched from its recipe with SGLang or the emulator, one emulator process (`emulate`), or the
# URLs of workers that run already. `fedctl up` always emulates.
WorkerSource = Literal["sglang", "emulator", "emulate"] | Annotated[tuple[StrictStr, ...], Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where a deployment's certificates are: the CA's, and each holder's as `fedctl ca issue`
    names them in one directory (scheduler.crt, gateway.crt, site-NAME.crt, with their keys)."""

    ca: Path
    certs: Path

    def files(self, identity: Identity) -> tuple[Path, Path]:
        return self.certs / f"{identity.file_stem}.crt", self.certs / f"{identity.file_stem}.key"


@dataclass(frozen=True, slots=True)
class Config:
    """A federation as its file says it (`parse`): the file's sections as validated, with the
    links as round trips both ways, relative paths resolved and the built-in recipes filled in."""

    model: str
    host: str
    speed: float
    gateway: GatewaySection
    scheduler: SchedulerSection
    # Emulated workers send a stream event every this many decode steps (SGLang's
    # --stream-interval; 1, its default, is an event per token). A larger one is coarser
    # chunking than a real site's, and any result measured with it must say so.
    stream_interval: int = 1
    rtt_ms: dict[tuple[str, str], float] = field(default_factory=dict)  # both orders present
    # The round trips of the links that carry only control calls (sites' registrations and
    # reports, Routes) when they differ from `rtt_ms`: a slowed bench stretches the data path's
    # round trips with its GPUs, but not the control plane's clocks (heartbeats, timeouts), so
    # its control links keep the real ones. None: `rtt_ms`.
    control_rtt_ms: dict[tuple[str, str], float] | None = None
    sites: tuple[SiteConfig, ...] = ()
    timings: Timings = field(default_factory=Timings)  # each component's waits (core/settings.py)
    # How each GPU type's site starts its workers (core/recipes.py): the built-in ones, with
    # those the file's `recipes:` names replacing theirs.
    recipes: dict[str, Recipe] = field(default_factory=lambda: dict(DEFAULT_RECIPES))
    # A deployment across machines: what each process listens on (None: `host`), the certificates.
    bind_host: str | None = None
    tls: TlsFiles | None = None

    @property
    def scheduler_region(self) -> str:
        """The schedulers' region: the file's, else the gateway's."""
        return self.gateway.region if self.scheduler.region is None else self.scheduler.region

    def with_gateway(self, **changes: Any) -> Config:
        """This federation with its gateway section's `changes` (already valid values)."""
        return replace(self, gateway=self.gateway.model_copy(update=changes))

    def with_scheduler(self, **changes: Any) -> Config:
        """This federation with its scheduler section's `changes` (already valid values)."""
        return replace(self, scheduler=self.scheduler.model_copy(update=changes))

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway.port}"

    @property
    def bind(self) -> str:
        return self.host if self.bind_host is None else self.bind_host

    @property
    def across_machines(self) -> bool:
        """Whether the file places processes on other machines (`fedctl up` runs one machine's)."""
        return self.scheduler.addresses is not None or any(s.address is not None for s in self.sites)

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        """The replicas' addresses as dialled: the file's, else `host` and one port each."""
        if self.scheduler.addresses is not None:
            return tuple(self.scheduler.addresses)
        return tuple(f"{self.host}:{self.scheduler.port + i}" for i in range(self.scheduler.replicas))

    def scheduler_listen_port(self, replica: int) -> int:
        """Replica `replica`'s port: its address's when the file places it, else one per replica."""
        if self.scheduler.addresses is not None:
            return int(self.scheduler.addresses[replica].rsplit(":", 1)[1])
        return self.scheduler.port + replica

    def agent_address(self, site: SiteConfig) -> str:
        return site.address or f"{self.host}:{site.agent_port}"

    def rtt_between(self, a: str, b: str) -> float:
        """The round trip between two regions; ConfigError when `links` does not say it (a
        missing link is a typo far more often than a 0-ms ocean)."""
        if a == b:
            return 0.0
        try:
            return self.rtt_ms[(a, b)]
        except KeyError:
            raise ConfigError(f"no `links` entry between {a} and {b}: say its rtt_ms") from None

    def control_rtt_between(self, a: str, b: str) -> float:
        if self.control_rtt_ms is None or a == b:
            return self.rtt_between(a, b)
        return self.control_rtt_ms[(a, b)]

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
            gateway=self.gateway if port is None else self.gateway.model_copy(update={"port": port}),
            scheduler=self.scheduler if policy is None else self.scheduler.model_copy(update={"policy": policy}),
            speed=self.speed if speed is None else speed,
            stream_interval=self.stream_interval if stream_interval is None else stream_interval,
        )

    def with_gpus(self, gpus: Mapping[str, int]) -> Config:
        """The named sites with that many GPUs each (a smaller federation of the same shape)."""
        return replace(self, sites=tuple(replace(s, gpus=gpus.get(s.name, s.gpus)) for s in self.sites))


_POSITIVE_INT = Annotated[int, Strict(), Field(ge=1)]
_PORT = Annotated[int, Strict(), Field(ge=1, le=65535)]
_NUMBER = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # an int is a number too, a bool is not


class _Section(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt key is an error, not a default


class GatewaySection(_Section):
    """The file's `gateway:`."""

    port: _PORT = 8080
    region: StrictStr = ""
    # Gateway processes sharing the port (SO_REUSEPORT): each open request holds a socket,
    # and one process has 20,000 file descriptors here; a federation at MLPerf load has more.
    processes: _POSITIVE_INT = 1
    ttft_budget_ms: Annotated[_NUMBER, Field(ge=0)] = 0.0  # latency mode when > 0 (federation/gateway/admission.py)
    # Throughput mode: by service tier, the longest a request may expect to wait for a site
    # before it is refused with 429 (0: no bound); a tier not named keeps core/tiers.py's.
    patience_s: dict[TierName, Annotated[_NUMBER, Field(ge=0)]] = {}
    api_keys: StrictStr = ""  # the keys file (`fedctl keys add`), from the file's directory; "": an open endpoint
    open: StrictBool = False  # serve without api_keys on a host other than loopback, on purpose
    # Open connections one client address may hold at a gateway process (0: no cap). A bench's
    # or drill's load generator is one address with thousands of streams: they set 0.
    max_connections_per_address: Annotated[int, Strict(), Field(ge=0)] = 1024


def _address(value: str) -> str:
    """host:port, with a port a listener can have."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port")
    return value


_ADDRESS = Annotated[StrictStr, pydantic.AfterValidator(_address)]


class SchedulerSection(_Section):
    """The file's `scheduler:`."""

    port: _PORT = 50051  # the first replica's; replica i listens on port + i
    region: StrictStr | None = None  # None: the gateway's (Config.scheduler_region)
    replicas: _POSITIVE_INT = 1  # active-active: any of them can decide, agents report to all
    policy: StrictStr = "least_expected_delay"
    metrics_port: _PORT | None = None  # replica i's /metrics on metrics_port + i
    addresses: tuple[_ADDRESS, ...] | None = None  # replica i's host:port as dialled, on machines of their own

    @pydantic.model_validator(mode="after")
    def _known(self) -> SchedulerSection:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler.policy must be one of {', '.join(sorted(POLICIES))}")
        if self.addresses is not None and len(self.addresses) != self.replicas:
            raise ValueError(f"scheduler.addresses names {len(self.addresses)}, one per replica ({self.replicas})")
        for name, port in (("port", self.port), ("metrics_port", self.metrics_port)):
            if port is not None and port + self.replicas - 1 > 65535:
                raise ValueError(f"the last replica's {name} ({name} + replicas - 1) must be <= 65535")
        return self


class _Link(_Section):
    between: tuple[StrictStr, StrictStr]
    rtt_ms: Annotated[_NUMBER, Field(ge=0)]


@pydantic.dataclasses.dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class SiteConfig:
    """A site as the file writes it and as every process uses it: one definition, validated
    wherever one is made (the file, `fedctl site add`, a drill's joining site)."""

    name: StrictStr
    region: StrictStr
    gpu: GpuName
    gpus: _POSITIVE_INT
    agent_port: _PORT
    worker_port: _PORT | None = None  # first port of the emulated workers; None: any free block
    metrics_port: _PORT | None = None  # the agent's /metrics (docs/METRICS.md); None: not served
    # processes reading the workers' streams beside the agent (its --readers; at most its MAX_READERS)
    readers: Annotated[int, Strict(), Field(ge=0, le=64)] = 0
    address: _ADDRESS | None = None  # host:port gateways and operators dial; None: the config's host
    workers: WorkerSource | None = None

    @pydantic.model_validator(mode="after")
    def _ports(self) -> SiteConfig:
        if self.worker_port is not None and self.worker_port + self.gpus - 1 > 65535:
            raise ValueError("the last worker's port (worker_port + gpus - 1) must be <= 65535")
        return self


class _Tls(_Section):
    ca: StrictStr  # the federation CA's certificate
    certs: StrictStr  # the directory of every holder's certificate and key, as `fedctl ca issue --out` writes them


class _File(_Section):
    """The config file as written: every key, its type and its bounds."""

    model: StrictStr = "openai/gpt-oss-120b"
    host: StrictStr = "127.0.0.1"
    bind: StrictStr | None = None  # what every process listens on (default: host)
    tls: _Tls | None = None
    speed: Annotated[_NUMBER, Field(gt=0)] = 1.0
    stream_interval: _POSITIVE_INT = 1
    gateway: GatewaySection = GatewaySection()
    scheduler: SchedulerSection = SchedulerSection()
    links: list[_Link] = []
    sites: Annotated[list[SiteConfig], Field(min_length=1)]
    timings: Timings = Timings()
    recipes: dict[GpuName, Recipe] = {}


def parse(text: str, source: str = "config", base: Path | None = None) -> Config:
    """The file's Config; ConfigError saying, on one line, each field that is wrong. Relative
    paths in it (tls, gateway.api_keys) are from `base`, the file's directory (else as given)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None  # one line
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        file = _File.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(describe(exc, source)) from None
    rtt: dict[tuple[str, str], float] = {}
    for link in file.links:
        a, b = link.between
        rtt[(a, b)] = rtt[(b, a)] = float(link.rtt_ms)
    sites = tuple(file.sites)
    if len({s.name for s in sites}) != len(sites):
        raise ConfigError(f"{source}: site names must be unique")
    gateway = file.gateway
    if gateway.api_keys:
        gateway = gateway.model_copy(update={"api_keys": str(_from(base, gateway.api_keys))})
    config = Config(
        model=file.model,
        host=file.host,
        speed=float(file.speed),
        gateway=gateway,
        scheduler=file.scheduler,
        stream_interval=file.stream_interval,
        rtt_ms=rtt,
        sites=sites,
        timings=file.timings,
        recipes={**DEFAULT_RECIPES, **{str(gpu): recipe for gpu, recipe in file.recipes.items()}},
        bind_host=file.bind,
        tls=TlsFiles(_from(base, file.tls.ca), _from(base, file.tls.certs)) if file.tls is not None else None,
    )
    try:
        for site in config.sites:
            config.rtt_between(site.region, config.gateway.region)
            config.rtt_between(site.region, config.scheduler_region)
        config.rtt_between(config.gateway.region, config.scheduler_region)
        for site in config.sites:
            config.recipes[site.gpu].workers(site.gpus)
    except (ConfigError, RecipeError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _check_ports(config, source)
    if not (config.gateway.api_keys or config.gateway.open or runtime.is_loopback(config.host)):
        raise ConfigError(
            f"{source}: host {config.host} serves the gateway beyond this machine, and without gateway.api_keys "
            "anyone who reaches its port may use it: set gateway.api_keys (`fedctl keys add`), or gateway.open: "
            "true to serve anyone on purpose"
        )
    return config


def _from(base: Path | None, path: str) -> Path:
    return Path(path) if base is None else base / path


def _check_ports(config: Config, source: str) -> None:
    """Two listeners on one port of one machine fail only at start-up, half-started; say it when
    the file is read. A process the file places on a machine of its own (an address) is on that
    machine; the others are on `host`."""
    owners: dict[tuple[str, int], str] = {}

    def claim(machine: str, port: int, owner: str) -> None:
        if (machine, port) in owners:
            raise ConfigError(f"{source}: port {port} is both {owners[(machine, port)]}'s and {owner}'s")
        owners[(machine, port)] = owner

    def machine_of(address: str | None) -> str:
        return config.host if address is None else address.rpartition(":")[0]

    claim(config.host, config.gateway.port, "the gateway")
    for i in range(config.scheduler.replicas):
        machine = machine_of(config.scheduler_addresses[i] if config.scheduler.addresses else None)
        claim(machine, config.scheduler_listen_port(i), f"scheduler replica {i}")
        if config.scheduler.metrics_port is not None:
            claim(machine, config.scheduler.metrics_port + i, f"scheduler replica {i}'s metrics")
    for site in config.sites:
        machine = machine_of(site.address)
        claim(machine, site.agent_port, f"{site.name}'s agent")
        if site.metrics_port is not None:
            claim(machine, site.metrics_port, f"{site.name}'s agent's metrics")
        if site.worker_port is not None:
            for gpu in range(site.gpus):
                claim(machine, site.worker_port + gpu, f"{site.name}'s worker {gpu}")


def load(path: Path | None = None) -> Config:
    """The config at `path`, else at $FEDERATION_CONFIG, else the built-in default."""
    path = path or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    if path is None:
        return parse(DEFAULT_YAML, "built-in default")
    try:
        return parse(path.read_text(), str(path), path.parent)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
