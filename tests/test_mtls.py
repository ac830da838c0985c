"""The federation's CA and mutual TLS: `fedctl ca` makes certificates that name their holder's
role (and a site's name), a server takes calls only from holders of the CA's certificates, a
client takes only the server it meant, and the server reads who called."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest

from core import mtls, pki
from core.pki import Identity, Role
from tests.conftest import fedctl

SCHEDULER, GATEWAY, KR = Identity(Role.SCHEDULER), Identity(Role.GATEWAY), Identity(Role.SITE, "kr-mi300x")


def _creds(ca: Path, identity: Identity, out: Path) -> pki.Credentials:
    cert, key = pki.issue(ca, identity, out, ("127.0.0.1",))
    return pki.load(ca / pki.CA_CERT, cert, key)


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    return pki.init_ca(tmp_path / "ca")


async def _serve_who(creds: pki.Credentials) -> tuple[grpc.aio.Server, int]:
    """A server whose one method answers with the caller's identity, as a service authorises by."""

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        identity = mtls.peer(context)
        return str(identity).encode() if identity else b"nobody"

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(who)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Who", {"Ask": handler})])
    port = server.add_secure_port("127.0.0.1:0", mtls.server_credentials(creds))
    await server.start()
    return server, port


async def _ask(channel: grpc.aio.Channel) -> str:
    answer = await channel.unary_unary("/test.Who/Ask")(b"", timeout=10)
    return answer.decode()


async def test_only_the_cas_holders_reach_a_server_and_it_knows_who_called(ca: Path, tmp_path: Path) -> None:
    server, port = await _serve_who(_creds(ca, SCHEDULER, tmp_path / "s"))
    address = f"127.0.0.1:{port}"
    try:
        for caller in (GATEWAY, KR):
            async with mtls.secure_channel(address, _creds(ca, caller, tmp_path / "c"), SCHEDULER) as channel:
                assert await _ask(channel) == caller.common_name
        # No certificate at all: no connection.
        plain = grpc.ssl_channel_credentials(root_certificates=(ca / pki.CA_CERT).read_bytes())
        options = mtls.channel_options(SCHEDULER)
        async with grpc.aio.secure_channel(address, plain, options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _ask(channel)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA: no connection either.
        other = pki.init_ca(tmp_path / "other-ca")
        async with mtls.secure_channel(address, _creds(other, GATEWAY, tmp_path / "o"), SCHEDULER) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await _ask(channel)
        # Plaintext: no connection.
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await _ask(channel)
    finally:
        await server.stop(None)


async def test_a_client_refuses_a_server_that_is_not_the_one_it_meant(ca: Path, tmp_path: Path) -> None:
    """A site's agent serving with its own certificate is not a scheduler, even from the CA."""
    server, port = await _serve_who(_creds(ca, KR, tmp_path / "kr"))
    try:
        async with mtls.secure_channel(f"127.0.0.1:{port}", _creds(ca, GATEWAY, tmp_path / "g"), SCHEDULER) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await _ask(channel)
        async with mtls.secure_channel(f"127.0.0.1:{port}", _creds(ca, GATEWAY, tmp_path / "g"), KR) as channel:
            assert await _ask(channel) == "gateway"
    finally:
        await server.stop(None)


def test_identities_are_read_strictly() -> None:
    assert Identity.from_common_name("site:us-mi355x") == Identity(Role.SITE, "us-mi355x")
    assert Identity.from_common_name("operator") == Identity(Role.OPERATOR)
    for bad in ("site:", "site", "gateway:kr", "root", ""):
        with pytest.raises(pki.PkiError):
            Identity.from_common_name(bad)


def test_fedctl_ca_makes_keys_only_their_owner_reads(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    assert fedctl("ca", "init", "--dir", str(ca)).returncode == 0
    done = fedctl("ca", "issue", "--site", "kr-mi300x", "--dir", str(ca), "--host", "kr.example.net")
    assert done.returncode == 0 and "kr-mi300x.sites.federation.internal" in done.stdout
    for key in (ca / "ca.key", ca / "site-kr-mi300x.key"):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    again = fedctl("ca", "init", "--dir", str(ca))  # would orphan every certificate it signed
    assert again.returncode == 2 and "already holds a CA" in again.stderr
    (ca / "site-kr-mi300x.key").chmod(0o644)
    with pytest.raises(pki.PkiError, match="owner only"):
        pki.load(ca / "ca.crt", ca / "site-kr-mi300x.crt", ca / "site-kr-mi300x.key")
