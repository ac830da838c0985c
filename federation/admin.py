"""Operator actions on every scheduler replica: state, drain, undrain, remove; and joining an
agent that waits for them.

Replicas are active-active with soft state, so an admin action goes to each one that
answers; the state is read from the first that answers.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

import grpc

from core import wire
from core.credential import bearer
from core.mtls import Tls
from core.pki import SCHEDULER, Identity, Role

ADMIN_TIMEOUT_S = 3.0
MAX_METRICS_BYTES = 8 * 1024**2  # a gateway's /metrics, read at most (its per-key families grow with the keys)
DRAIN_POLL_S = 0.5


class NoReplica(RuntimeError):
    """No scheduler replica answered."""


def fetch_state(scheduler: str, tls: Tls) -> wire.FederationState:
    with tls.sync_channel(scheduler, SCHEDULER) as channel:
        stub = wire.SchedulerStub(channel)
        return wire.federation_state_from_pb(stub.GetState(wire.state_request_to_pb(), timeout=ADMIN_TIMEOUT_S))


def replicas_state(addresses: Sequence[str], tls: Tls) -> tuple[wire.FederationState | None, dict[str, str]]:
    """The first answering replica's state (None if none answers), and every replica's status."""
    state, reachable = None, {}
    for address in addresses:
        try:
            seen = fetch_state(address, tls)
        except grpc.RpcError as exc:
            reachable[address] = f"unreachable ({exc.code().name})"
            continue
        reachable[address] = "ok"
        state = state or seen
    return state, reachable


def gateway_health(gateway_url: str) -> dict:
    """The gateway's own view (its /health): what `fedctl status` shows when no scheduler answers,
    and how a drill sees a scheduler failover."""
    try:
        with urllib.request.urlopen(gateway_url + "/health", timeout=ADMIN_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")
    except (OSError, ValueError) as exc:
        return {"status": "unreachable", "reason": str(exc)}


def gateway_metrics(gateway_url: str) -> str | None:
    """The gateway's /metrics as text (every process's, when several share its port); None when
    it does not answer: `fedctl status` then shows the sites without the gateway's tiers."""
    try:
        with urllib.request.urlopen(gateway_url + "/metrics", timeout=ADMIN_TIMEOUT_S) as resp:
            return resp.read(MAX_METRICS_BYTES).decode()
    except (OSError, ValueError):
        return None


class Refused(PermissionError):
    """A replica refused the operator's certificate (the reason is its own)."""


def _on_each(addresses: Sequence[str], tls: Tls, call: Callable[[wire.SchedulerStub], object]) -> list[str]:
    """Run `call` on every replica; returns the ones that took it. NOT_FOUND and a refusal are raised."""
    done = []
    for address in addresses:
        with tls.sync_channel(address, SCHEDULER) as channel:
            try:
                call(wire.SchedulerStub(channel))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise LookupError(exc.details()) from None
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    raise Refused(f"{address}: {exc.details()}") from None
                continue
            done.append(address)
    if not done:
        raise NoReplica(f"no scheduler replica answered: {', '.join(addresses)}")
    return done


def drain(addresses: Sequence[str], tls: Tls, site: str, draining: bool = True) -> list[str]:
    ref = wire.site_ref_to_pb(site)
    if draining:
        return _on_each(addresses, tls, lambda stub: stub.DrainSite(ref, timeout=ADMIN_TIMEOUT_S))
    return _on_each(addresses, tls, lambda stub: stub.UndrainSite(ref, timeout=ADMIN_TIMEOUT_S))


def remove(addresses: Sequence[str], tls: Tls, site: str) -> list[str]:
    ref = wire.site_ref_to_pb(site)
    return _on_each(addresses, tls, lambda stub: stub.RemoveSite(ref, timeout=ADMIN_TIMEOUT_S))


def wait_empty(addresses: Sequence[str], tls: Tls, site: str, timeout_s: float, on_poll: Callable[[int], None]) -> bool:
    """Poll until the draining site has no request in flight; False if `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = replicas_state(addresses, tls)
        if state is None:
            raise NoReplica("no scheduler replica answered")
        sites = {s.name: s for s in state.sites}
        if site not in sites:
            raise LookupError(f"no site named {site!r}")
        in_flight = sites[site].outstanding_requests
        on_poll(in_flight)
        if in_flight == 0:
            return True
        time.sleep(DRAIN_POLL_S)
    return False


def join_agent(agent: str, tls: Tls, request: wire.JoinRequest, credential: str) -> str:
    """Tell the agent at `agent` to join `request.schedulers`; the address it registers.
    Raises grpc.RpcError with the agent's reason when it refuses."""
    with tls.sync_channel(agent, Identity(Role.SITE, request.site)) as channel:
        reply = wire.SiteAgentStub(channel).Join(
            wire.join_request_to_pb(request), metadata=bearer(credential), timeout=ADMIN_TIMEOUT_S
        )
    return reply.agent_address


def wait_joined(addresses: Sequence[str], tls: Tls, site: str, since_unix_s: float, timeout_s: float) -> str | None:
    """Poll until the site is ready at every replica (None), or a replica refused it after
    `since_unix_s` (its reason). Raises TimeoutError when neither happens within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = 0
        for address in addresses:
            try:
                state = fetch_state(address, tls)
            except grpc.RpcError:
                continue
            refused = [r for r in state.refused if r.name == site and r.at_unix_s >= since_unix_s]
            if refused:
                return refused[-1].reason
            ready += any(s.name == site and s.status is wire.SiteStatus.READY for s in state.sites)
        if ready == len(addresses):
            return None
        time.sleep(DRAIN_POLL_S)
    raise TimeoutError(f"{site} was not ready at every scheduler replica within {timeout_s:.0f} s")
