"""Who may call which RPC, by the role and site its certificate names (`core.pki`).

Every method of the schedulers' and the agents' services asks its `Guard` first:

- a site registers and reports, and only as the site its certificate names;
- a gateway routes, reads and watches the state, and runs and cancels generations at agents;
- an operator drains, undrains and removes sites, reads the state, and joins waiting agents;
- a scheduler's certificate serves; it calls nothing.

A refused call gets UNAUTHENTICATED (a certificate of no role of ours: cannot happen through the
TLS handshake, but the check does not rely on it) or PERMISSION_DENIED with the reason, is
counted (`federation_rpc_refused_total`) and logged, and changes nothing: the check comes before
the method reads its request. A process started `--insecure` authorises nothing by certificate
(there is none); the join credential is then its only check (`core.credential`).
"""

from __future__ import annotations

import grpc
import prometheus_client
import structlog

from core.mtls import INSECURE, Tls, peer
from core.pki import Identity, Role

log = structlog.get_logger("authz")

_SITE, _GATEWAY, _OPERATOR = Role.SITE, Role.GATEWAY, Role.OPERATOR
ALLOWED: dict[str, frozenset[Role]] = {
    "RegisterSite": frozenset({_SITE}),
    "Report": frozenset({_SITE}),
    "Route": frozenset({_GATEWAY}),
    "RouteStream": frozenset({_GATEWAY}),
    "GetState": frozenset({_GATEWAY, _OPERATOR}),
    "WatchState": frozenset({_GATEWAY, _OPERATOR}),
    "DrainSite": frozenset({_OPERATOR}),
    "UndrainSite": frozenset({_OPERATOR}),
    "RemoveSite": frozenset({_OPERATOR}),
    "Generate": frozenset({_GATEWAY}),
    "Join": frozenset({_OPERATOR}),
}

REFUSED = prometheus_client.Counter(
    "federation_rpc_refused", "gRPC calls refused by their caller's certificate", ("method", "code")
)


class Guard:
    """One server's authorisation: `admit` at the top of each method."""

    def __init__(self, tls: Tls) -> None:
        self.tls = tls

    def refusal(
        self, context: grpc.aio.ServicerContext, method: str, site: str | None = None
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why the caller may not call `method` (as `site`, when the call acts for one), counted
        and logged; None when it may."""
        if self.tls.insecure:
            return None
        identity = peer(context)
        if identity is None:
            return self._refuse(method, None, grpc.StatusCode.UNAUTHENTICATED, "the certificate names no role")
        if identity.role not in ALLOWED[method]:
            return self._refuse(
                method, identity, grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not call {method}"
            )
        if site is not None and identity.role is Role.SITE and identity.site != site:
            reason = f"{identity} may act only as site {identity.site!r}, not {site!r}"
            return self._refuse(method, identity, grpc.StatusCode.PERMISSION_DENIED, reason)
        return None

    async def admit(self, context: grpc.aio.ServicerContext, method: str, site: str | None = None) -> None:
        """Abort the call unless its caller may make it."""
        refused = self.refusal(context, method, site)
        if refused is not None:
            await context.abort(*refused)

    @staticmethod
    def _refuse(
        method: str, identity: Identity | None, code: grpc.StatusCode, reason: str
    ) -> tuple[grpc.StatusCode, str]:
        REFUSED.labels(method, code.name).inc()
        log.warning("rpc.refused", method=method, caller=str(identity or "unknown"), code=code.name, reason=reason)
        return code, reason


UNGUARDED = Guard(INSECURE)  # a process started --insecure: no certificates to authorise by
