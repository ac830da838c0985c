"""The join credential on the wire: a site presents it to the schedulers (RegisterSite, Report),
and an operator presents it to an agent waiting to be joined (Join), as gRPC metadata
`authorization: Bearer <credential>`. Where none is set, anyone may call (one machine)."""

from __future__ import annotations

import hmac

import grpc


def bearer(credential: str) -> tuple[tuple[str, str], ...]:
    """What a call carries to present `credential` ("": nothing)."""
    return (("authorization", f"Bearer {credential}"),) if credential else ()


def presented(context: grpc.aio.ServicerContext, credential: str) -> bool:
    """The call carries `credential`, or none is required."""
    if not credential:
        return True
    given = dict(context.invocation_metadata()).get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {credential}".encode())
