"""Each process's command line from the federation's one config file.

A real deployment runs the scheduler replicas, the gateway and each site's agent on machines
of their own. They read the same validated file as `fedctl up` (`core/config.py`):
`python -m scheduler --config F --replica I`, `python -m federation.gateway --config F` and
`python -m nodes.agent --config F --site NAME` each take their part of it, so that what one
process dials is what the other listens on, and a fault in the file stops every process at its
start with the same message. The embedded default builds its processes' command lines here too.

Flags given beside `--config` override the file's: a flag the command line gives replaces every
value the file gives it (`--scheduler` named twice on the command line replaces the file's
list), and the agent's way to its workers (`--worker-url`, `--emulate`, `--launch`) is one
choice, which the command line makes when it names any of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from core.config import Config, ConfigError, SiteConfig, load
from core.pki import GATEWAY, SCHEDULER, Identity, Role
from core.settings import to_json

# Flags that are one choice between them: the command line naming one replaces the file's.
_CHOICES = (frozenset({"--worker-url", "--emulate", "--launch"}),)


class DeploymentError(ConfigError):
    """`--config` with a process the file does not describe (a replica or site it lacks)."""


def rtt_args(config: Config) -> list[str]:
    return [f"--rtt-ms={a}:{b}={ms:g}" for (a, b), ms in sorted(config.rtt_ms.items()) if a < b]


def timings_args(timings: object) -> list[str]:
    """A component's `--timings`, when the config changes any of its defaults."""
    return [] if timings == type(timings)() else ["--timings", to_json(timings)]


def tls_args(config: Config, identity: Identity) -> list[str]:
    """The config's certificates for `identity` (none when the file names no `tls`)."""
    if config.tls is None:
        return []
    cert, key = config.tls.files(identity)
    return ["--ca", str(config.tls.ca), "--cert", str(cert), "--key", str(key)]


def scheduler_args(config: Config, replica: int) -> list[str]:
    """Replica `replica`'s command line (`python -m scheduler`)."""
    if not 0 <= replica < config.scheduler.replicas:
        raise DeploymentError(f"the config has scheduler replicas 0..{config.scheduler.replicas - 1}, not {replica}")
    metrics = config.scheduler.metrics_port
    return [
        *("--host", config.bind, "--port", str(config.scheduler_listen_port(replica))),
        *("--model", config.model, "--policy", config.scheduler.policy),
        *(["--metrics-port", str(metrics + replica)] if metrics else []),
        *(a for path in sorted({r.model_path for r in config.recipes.values()}) for a in ("--checkpoint", path)),
        *rtt_args(config),
        *timings_args(config.timings.scheduler),
        *tls_args(config, SCHEDULER),
    ]


def gateway_args(config: Config, schedulers: Sequence[str] | None = None) -> list[str]:
    """The gateway's command line (`python -m federation.gateway`); `schedulers`: the addresses
    it dials instead of the file's (the embedded default's WAN links)."""
    return [
        *("--host", config.bind, "--port", str(config.gateway.port), "--model", config.model),
        *("--policy", config.scheduler.policy, "--ttft-budget-ms", f"{config.gateway.ttft_budget_ms:g}"),
        *(a for address in schedulers or config.scheduler_addresses for a in ("--scheduler", address)),
        *rtt_args(config),
        *timings_args(config.timings.gateway),
        *(["--api-keys", config.gateway.api_keys] if config.gateway.api_keys else []),
        *(["--open"] if config.gateway.open else []),
        *("--max-connections-per-address", str(config.gateway.max_connections_per_address)),
        *(a for tier, s in config.gateway.patience_s.items() for a in ("--patience-s", f"{tier}={s:g}")),
        *tls_args(config, GATEWAY),
    ]


def agent_args(
    config: Config, site: SiteConfig, schedulers: Sequence[str] | None = None, advertise: str | None = None
) -> list[str]:
    """A site's agent's command line (`python -m nodes.agent`), its workers as the file says;
    `schedulers` and `advertise`: the addresses to use instead of the file's."""
    return [
        *("--site", site.name, "--region", site.region, "--gpu", site.gpu, "--gpus", str(site.gpus)),
        *("--model", config.model, "--host", config.bind, "--port", str(site.agent_port)),
        *("--advertise", advertise or config.agent_address(site)),
        *(a for address in schedulers or config.scheduler_addresses for a in ("--scheduler", address)),
        *_workers_args(site),
        *(["--metrics-port", str(site.metrics_port)] if site.metrics_port else []),
        *(["--readers", str(site.readers)] if site.readers else []),
        *timings_args(config.timings.agent),
        *tls_args(config, Identity(Role.SITE, site.name)),
    ]


def _workers_args(site: SiteConfig) -> list[str]:
    if site.workers is None:
        return []
    if isinstance(site.workers, tuple):
        return [a for url in site.workers for a in ("--worker-url", url)]
    return ["--emulate"] if site.workers == "emulate" else ["--launch", site.workers]


def add_config_argument(parser: argparse.ArgumentParser, replica: bool = False) -> None:
    """`--config FILE` (and the scheduler's `--replica I`) in the process's --help; `expand`
    takes them off the command line before the process's parser reads it."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the federation's config file: this process's part of it (flags given override it)",
    )
    if replica:
        parser.add_argument("--replica", type=int, default=0, help="with --config: which scheduler replica this is")


def expand(argv: Sequence[str], program: str) -> list[str]:
    """`argv` with `--config FILE` (and `--replica I` for the scheduler) replaced by the file's
    command line for this process, the rest of `argv` overriding it; `argv` itself without
    `--config`. A file that cannot be used is a usage error (exit 2) with the config's message."""
    pre = argparse.ArgumentParser(prog=f"python -m {program}", add_help=False)
    add_config_argument(pre, replica=program == "scheduler")
    known, rest = pre.parse_known_args(list(argv))
    if known.config is None:
        return list(argv)
    try:
        config = load(known.config)
        if program == "scheduler":
            base = scheduler_args(config, known.replica)
        elif program == "federation.gateway":
            base = gateway_args(config)
        else:
            base = _agent_args_for(config, rest, known.config)
    except ConfigError as exc:
        pre.error(str(exc))
    return [*_without(base, _flags(rest)), *rest]


def _agent_args_for(config: Config, rest: Sequence[str], path: Path) -> list[str]:
    """The agent of the site `--site` names; its recipes are the file's own `recipes:`."""
    names = [rest[i + 1] for i, arg in enumerate(rest[:-1]) if arg == "--site"]
    names += [arg.split("=", 1)[1] for arg in rest if arg.startswith("--site=")]
    if len(names) != 1:
        raise DeploymentError("with --config, name the site this agent serves: --site NAME")
    site = next((s for s in config.sites if s.name == names[0]), None)
    if site is None:
        raise DeploymentError(f"{path} has no site {names[0]!r} (it has {', '.join(s.name for s in config.sites)})")
    if site.workers is None and not _flags(rest) & _CHOICES[0]:
        raise DeploymentError(
            f"{path}: sites[{site.name}].workers is not set: sglang or emulator (launched from the site's recipe), "
            "emulate, or a list of its workers' URLs"
        )
    recipes = ["--recipes", str(path)] if isinstance(site.workers, str) else []
    return [*agent_args(config, site), *recipes]


def _flags(argv: Sequence[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}


def _without(base: list[str], given: set[str]) -> list[str]:
    """`base` less every flag in `given` (with its values), and less a whole choice of which
    `given` names one."""
    dropped = set(given)
    for choice in _CHOICES:
        if given & choice:
            dropped |= choice
    kept: list[str] = []
    skipping = False
    for arg in base:
        if arg.startswith("--"):
            skipping = arg.split("=", 1)[0] in dropped
        if not skipping:
            kept.append(arg)
    return kept
