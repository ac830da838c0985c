"""One error tree for the federation, mapped once at each boundary.

At the HTTP edge each error becomes its status and an OpenAI error body; gRPC status
codes from the scheduler and agents are mapped into it by the clients.
"""

from __future__ import annotations

from typing import Any


class FederationError(Exception):
    status = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequest(FederationError):
    status = 400
    error_type = "invalid_request_error"


class RequestTimeout(FederationError):
    """The client did not send its whole request in time (HTTP 408)."""

    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class ModelNotFound(FederationError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NoCapacity(FederationError):
    """No site can take the request now (none ready, or all refused it)."""

    status = 503
    error_type = "service_unavailable"


class UpstreamFailed(FederationError):
    """A site broke while serving the request."""

    status = 502
    error_type = "upstream_error"


class SiteWorkerFailed(UpstreamFailed):
    """One of a site's workers broke while serving the request; the site itself still serves
    (its agent stops using that worker), so the site is neither avoided nor held against."""


class TooBusy(FederationError):
    """No site can meet the request's TTFT budget and the gateway's hold queue is full, or the
    budget ran out while held: come back later (HTTP 429 with Retry-After)."""

    status = 429
    error_type = "rate_limit_exceeded"
    code = "ttft_budget_unmet"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TierBusy(TooBusy):
    """Throughput mode: every site would start the request later than its service tier waits
    (its patience; core/tiers.py): come back later (HTTP 429 with Retry-After)."""

    code = "tier_patience_exceeded"


class Unauthorized(FederationError):
    """No API key, or one the gateway does not know (HTTP 401, as OpenAI answers)."""

    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class NotAllowed(FederationError):
    """The key may not ask for this (HTTP 403: the openai client's PermissionDeniedError), e.g.
    a service tier above its ceiling."""

    status = 403
    error_type = "permission_error"
    code = "not_allowed"


class RateLimited(TooBusy):
    """The key is over one of its limits: come back after Retry-After (HTTP 429). Refused before
    any site is asked, so it costs the federation nothing."""

    code = "rate_limit_exceeded"


class TooManyConnections(TooBusy):
    """The client's address holds as many open connections as the gateway allows it (HTTP 429)."""

    code = "too_many_connections"
