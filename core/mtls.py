"""Mutual TLS on gRPC, and who called: the wire side of `core.pki`.

A server asks every client for a certificate from the federation's CA (no certificate, no
connection); a client checks that the server's certificate names what it meant to reach
(`scheduler.federation.internal`, `NAME.sites.federation.internal`), whatever address it dialled
(a WAN link proxy's, a load balancer's). `peer` reads the caller's identity for a service to
authorise the call by.
"""

from __future__ import annotations

import grpc

from core.pki import Credentials, Identity, PkiError


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
