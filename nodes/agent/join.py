"""An agent started without schedulers waits to be told them: `fedctl site add --agent`.

So an operator can start a site's agent beside its workers first, and add it to a federation
later, from wherever `fedctl` runs. Joining is the agent's own decision: it joins only as the
site it runs (the operator's name, region and GPUs must be its own), only once (a second call
naming other schedulers is refused, not followed), and, when it was given a join credential,
only for a caller that presents it: whoever names the schedulers decides where the site's
reports, and so its traffic, come from.
"""

from __future__ import annotations

import asyncio

import grpc

from core import wire
from core.credential import presented


def _describe(site: str, region: str, gpu: str, gpus: int) -> str:
    return f"{site!r} ({gpus} x {gpu} in {region})"


class JoinGate:
    """The schedulers the agent reports to: given at start (`--scheduler`), or by the first
    Join call it accepts."""

    def __init__(self, site: str, region: str, gpu: str, gpus: int, credential: str, schedulers: list[str]) -> None:
        self.declared = (site, region, gpu, gpus)
        self.credential = credential
        self.schedulers: asyncio.Future[tuple[str, ...]] = asyncio.get_running_loop().create_future()
        if schedulers:
            self.schedulers.set_result(tuple(schedulers))

    def join(self, request: wire.JoinRequest, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """None when the agent now reports to `request.schedulers`; else why not, as a gRPC status."""
        if not presented(context, self.credential):
            return grpc.StatusCode.UNAUTHENTICATED, "the call did not present this site's join credential"
        if not request.schedulers:
            return grpc.StatusCode.INVALID_ARGUMENT, "name at least one scheduler replica (host:port)"
        asked = (request.site, request.region, request.gpu, request.gpus)
        if asked != self.declared:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this agent runs site {_describe(*self.declared)}, not {_describe(*asked)}",
            )
        if not self.schedulers.done():
            self.schedulers.set_result(request.schedulers)
        elif set(self.schedulers.result()) != set(request.schedulers):
            joined = ", ".join(self.schedulers.result())
            return grpc.StatusCode.FAILED_PRECONDITION, f"this agent already reports to {joined}"
        return None
