"""`/metrics` for the processes that otherwise speak only gRPC (schedulers, site agents).

A site's load, capacity and workers are the federation's business, and its ports face the
WAN, so the endpoint is guarded as the gRPC services are: HTTPS under the federation's CA,
a client certificate required, and only an operator's accepted (Prometheus scrapes with one:
`tls_config` in monitoring/prometheus.yml). A process started `--insecure` serves plain HTTP,
as its gRPC is plaintext too. Nothing but GET /metrics is served; a scrape costs one pass
over the process's state (its collectors read it then), nothing between scrapes.
"""

from __future__ import annotations

import argparse
import ssl
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from core.mtls import Tls
from core.pki import OPERATOR, Credentials, Identity, PkiError

if TYPE_CHECKING:
    from aiohttp import web

log = structlog.get_logger("metrics")

MAX_BODY_BYTES = 1024  # a scrape is a GET: no body worth reading


def server_ssl_context(creds: Credentials) -> ssl.SSLContext:
    """TLS that asks every client for a certificate of the federation's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=creds.ca.decode())
    _load_own(context, creds)
    return context


def client_ssl_context(creds: Credentials) -> ssl.SSLContext:
    """TLS for a scraper (an operator's tool, a test): the federation's CA, and the caller's own
    certificate to present. The server's name is checked as the gRPC clients check it: pass
    its Identity's `server_name` as the connection's server_hostname."""
    context = ssl.create_default_context(cadata=creds.ca.decode())
    _load_own(context, creds)
    return context


def _load_own(context: ssl.SSLContext, creds: Credentials) -> None:
    """The holder's certificate and key into `context` (ssl reads a key only from a file: one in
    a directory only we can read, gone at once)."""
    with tempfile.TemporaryDirectory() as private:
        cert, key = Path(private) / "cert.pem", Path(private) / "key.pem"
        cert.write_bytes(creds.cert)
        key.touch(mode=0o600)
        key.write_bytes(creds.key)
        context.load_cert_chain(cert, key)


def _caller(request: web.Request) -> Identity | None:
    peer = request.transport.get_extra_info("peercert") if request.transport else None
    names = [value for rdn in (peer or {}).get("subject", ()) for key, value in rdn if key == "commonName"]
    if len(names) != 1:
        return None
    try:
        return Identity.from_common_name(names[0])
    except PkiError:
        return None


def build_app(registry: CollectorRegistry, tls: Tls) -> web.Application:
    # Imported here: a scheduler speaks only gRPC, and importing aiohttp is a noticeable part of
    # its start (on the path of every federation's) when no --metrics-port asks for this.
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        if not tls.insecure:
            caller = _caller(request)
            if caller != OPERATOR:
                log.warning("metrics.refused", caller=str(caller), peer=request.remote)
                return web.json_response(
                    {"error": f"/metrics is for operators; {caller or 'no role'} called"}, status=403
                )
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(registry: CollectorRegistry, host: str, port: int, tls: Tls) -> web.AppRunner:
    """Serving until the runner is cleaned up; OSError when the port cannot be had."""
    from aiohttp import web  # see build_app

    runner = web.AppRunner(build_app(registry, tls), access_log=None, handler_cancellation=True, keepalive_timeout=15)
    await runner.setup()
    context = None if tls.creds is None else server_ssl_context(tls.creds)
    try:
        await web.TCPSite(runner, host, port, ssl_context=context, reuse_address=True).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def announced(host: str, port: int | None, tls: Tls) -> dict[str, str]:
    """What a ready line says about the endpoint: `{"metrics": URL}`, or nothing without one."""
    if port is None:
        return {}
    return {"metrics": f"{'http' if tls.insecure else 'https'}://{host}:{port}/metrics"}


async def serve_asked(registry: CollectorRegistry, args: argparse.Namespace, process: str) -> web.AppRunner | None:
    """The endpoint `--metrics-port` asks for, on `--host`, with the process's `args.tls`; None
    when none is asked. OSError, logged as `PROCESS.bind_failed`, when its port cannot be had."""
    if args.metrics_port is None:
        return None
    try:
        return await serve(registry, args.host, args.metrics_port, args.tls)
    except OSError as exc:
        log.error(f"{process}.bind_failed", address=f"{args.host}:{args.metrics_port}", error=str(exc))
        raise
