"""What a drill acts on: a federation's gateway and scheduler replicas, and how to break it.

The embedded default is broken from inside (its processes are ours to kill, its emulated
workers take fault injections). An operator's federation (`fedctl drill --endpoint`) is
broken by the operator's own commands (`--inject`, `--heal`: kill an agent over ssh, cut a
link with iptables, ...), and watched through the same interfaces as the embedded one: the
gateway's /health and /metrics, and the schedulers' state.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from core import wire
from core.mtls import Tls
from federation import admin
from federation.embedded import Federation

COMMAND_TIMEOUT_S = 60.0


class DrillError(RuntimeError):
    """The drill cannot go on (a fault command failed, a fault the target cannot take)."""


class DrillRefused(DrillError):
    """The arguments name something the federation does not have (a site, a scheduler)."""


@dataclass
class Target:
    gateway_url: str  # http://host:port
    scheduler_addresses: list[str]
    operator: Tls  # what the drill presents to the schedulers
    federation: Federation | None = None  # the embedded default, when the drill started it
    inject_command: str | None = None
    heal_command: str | None = None

    @classmethod
    def embedded(cls, federation: Federation) -> Target:
        c = federation.config
        return cls(c.gateway_url, list(c.scheduler_addresses), federation.operator, federation)

    @property
    def endpoint(self) -> str:
        return self.gateway_url + "/v1"

    @property
    def metrics_url(self) -> str:
        return self.gateway_url + "/metrics"

    def live_schedulers(self) -> list[str]:
        """The replicas worth asking: for the embedded default, those whose process lives."""
        if self.federation is None:
            return list(self.scheduler_addresses)
        alive = [self.federation.child(f"scheduler {i}").alive() for i in range(len(self.scheduler_addresses))]
        return [address for address, up in zip(self.scheduler_addresses, alive, strict=True) if up]

    def site_states(self) -> dict[str, wire.SiteState]:
        """The sites as the first answering replica sees them ({} when none answers)."""
        state, _ = admin.replicas_state(self.live_schedulers(), self.operator)
        return {s.name: s for s in state.sites} if state else {}

    def gateway_health(self) -> dict:
        return admin.gateway_health(self.gateway_url)

    def gateway_alive(self) -> bool:
        if self.federation is None:
            return self.gateway_health().get("status") != "unreachable"
        return all(c.alive() for c in self.federation.children if c.name.startswith("gateway"))

    def own(self, action: str) -> Federation:
        """The embedded federation, to break from inside; an operator's needs a command."""
        if self.federation is None:
            raise DrillError(f"{action}: against --endpoint, give the command that does it (--inject/--heal)")
        return self.federation

    def run(self, command: str, site: str) -> None:
        """An operator's fault command, in a shell, with the site it is aimed at in
        FEDCTL_DRILL_SITE; a failure stops the drill with the command's own words."""
        env = {**os.environ, "FEDCTL_DRILL_SITE": site}
        try:
            done = subprocess.run(
                command, shell=True, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise DrillError(f"{command!r} did not finish within {COMMAND_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-500:]
            raise DrillError(f"{command!r} failed (exit {done.returncode}){': ' + said if said else ''}")
