"""Mutual TLS on gRPC, and who called: the wire side of `core.pki`.

A server asks every client for a certificate from the federation's CA (no certificate, no
connection); a client checks that the server's certificate names what it meant to reach
(`scheduler.federation.internal`, `NAME.sites.federation.internal`), whatever address it dialled
(a WAN link proxy's, a load balancer's). `peer` reads the caller's identity for a service to
authorise the call by.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from core.pki import Credentials, Identity, PkiError, holder, load


def server_credentials(creds: Credentials) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(creds.key, creds.cert)], root_certificates=creds.ca, require_client_auth=True)


def channel_credentials(creds: Credentials) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=creds.ca, private_key=creds.key, certificate_chain=creds.cert)


def channel_options(server: Identity) -> tuple[tuple[str, str], ...]:
    """Check the server's certificate for `server`'s name rather than the address dialled."""
    return (("grpc.ssl_target_name_override", server.server_name),)


def secure_channel(address: str, creds: Credentials, server: Identity, options: tuple = ()) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, channel_credentials(creds), options=(*options, *channel_options(server)))


def peer(context: grpc.aio.ServicerContext) -> Identity | None:
    """The caller's identity from its certificate; None on a plaintext call or a name of no role."""
    names = context.auth_context().get("x509_common_name") or []
    if len(names) != 1:
        return None
    try:
        return Identity.from_common_name(names[0].decode())
    except (PkiError, UnicodeDecodeError):
        return None


INSECURE_WARNING = "PLAINTEXT gRPC (--insecure): anyone on the network can read, forge and send every call"


@dataclass(frozen=True, slots=True)
class Tls:
    """A process's transport security: its credentials, or None when it was started `--insecure`
    (then it serves and dials plaintext, and its services authorise nothing by certificate)."""

    creds: Credentials | None

    @property
    def insecure(self) -> bool:
        return self.creds is None

    def listen(self, server: grpc.aio.Server, address: str) -> None:
        """Serve `server` at `address`; RuntimeError when the port cannot be had."""
        if self.creds is None:
            server.add_insecure_port(address)
        else:
            server.add_secure_port(address, server_credentials(self.creds))

    def channel(self, address: str, server: Identity, options: tuple = ()) -> grpc.aio.Channel:
        """An asyncio channel to `server` at `address` (which may be a proxy's)."""
        if self.creds is None:
            return grpc.aio.insecure_channel(address, options=options)
        return secure_channel(address, self.creds, server, options)

    def sync_channel(self, address: str, server: Identity, options: tuple = ()) -> grpc.Channel:
        """A blocking channel, for the command line and the agent's report thread."""
        if self.creds is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(
            address, channel_credentials(self.creds), options=(*options, *channel_options(server))
        )


INSECURE = Tls(None)


def add_arguments(parser: argparse.ArgumentParser, who: str) -> None:
    """`--ca/--cert/--key`, or `--insecure`: one of them is required."""
    group = parser.add_argument_group("transport security (mutual TLS; `fedctl ca issue` makes these)")
    group.add_argument("--ca", type=Path, help="the federation CA's certificate")
    group.add_argument("--cert", type=Path, help=f"this {who}'s certificate")
    group.add_argument("--key", type=Path, help=f"this {who}'s private key (mode 0600)")
    group.add_argument("--insecure", action="store_true", help="plaintext gRPC, no certificates (one machine only)")


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, expected: Identity) -> Tls:
    """The Tls `add_arguments`' flags ask for; a usage error (exit 2) where `tls_from` refuses."""
    try:
        return tls_from(args, expected)
    except PkiError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def given(args: argparse.Namespace) -> bool:
    """Whether any of `add_arguments`' flags was given."""
    return bool(args.insecure or args.ca or args.cert or args.key)


def tls_from(args: argparse.Namespace, expected: Identity) -> Tls:
    """The Tls `add_arguments`' flags ask for; PkiError when they are incomplete, contradictory,
    name files that cannot be used, or a certificate not `expected`'s (a gateway started with a
    site's certificate would be refused everywhere, and say so late)."""
    files = [args.ca, args.cert, args.key]
    if args.insecure:
        if any(files):
            raise PkiError("--insecure with --ca/--cert/--key: choose one")
        return INSECURE
    if not all(files):
        raise PkiError("give --ca, --cert and --key (fedctl ca issue makes them), or --insecure for plaintext")
    return load_tls(args.ca, args.cert, args.key, expected)


def load_tls(ca: Path, cert: Path, key: Path, expected: Identity) -> Tls:
    """`expected`'s credentials from files; PkiError when they cannot be used or are another's."""
    creds = load(ca, cert, key)
    try:
        named = holder(creds.cert)
    except PkiError as exc:
        raise PkiError(f"{cert}: {exc}") from None
    if named != expected:
        raise PkiError(f"{cert} is {named}'s certificate; this needs {expected}'s")
    return Tls(creds)


def warn_if_insecure(tls: Tls, log: structlog.typing.FilteringBoundLogger) -> None:
    if tls.insecure:
        log.warning("tls.insecure", warning=INSECURE_WARNING)
