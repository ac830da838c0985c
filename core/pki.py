"""The federation's certificate authority, and who a certificate says its holder is.

Every gRPC hop crosses the public internet (Korea ↔ Oregon), so every one is mutual TLS under
one federation CA: the CA signs each component's certificate, and each end checks the other's.
A certificate's common name is its holder's identity, which the services authorise calls by:

- `scheduler`: serves the Scheduler service (its certificate also names `scheduler.<domain>`,
  which every client checks it is talking to);
- `site:NAME`: a site's agent, which serves the gateways' Generate calls (as `NAME.sites.<domain>`)
  and registers and reports to the schedulers as NAME, and only as NAME;
- `gateway`: routes requests and streams from agents;
- `operator`: drains, undrains, removes sites and reads state (`fedctl`).

Keys are written mode 0600 and never leave the machine that made them; `fedctl ca issue` prints
where they went. Made with `cryptography` (no shell-out to openssl).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DOMAIN = "federation.internal"  # names the clients check; never resolved (gRPC's target name override)
CA_CERT, CA_KEY = "ca.crt", "ca.key"
CA_VALID_DAYS = 3650
CERT_VALID_DAYS = 365


class Role(Enum):
    SCHEDULER = "scheduler"
    SITE = "site"
    GATEWAY = "gateway"
    OPERATOR = "operator"


class PkiError(ValueError):
    """A CA or certificate that cannot be made or read; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a peer's certificate says it is."""

    role: Role
    site: str = ""  # for Role.SITE: the site it may act as

    @property
    def common_name(self) -> str:
        return f"site:{self.site}" if self.role is Role.SITE else self.role.value

    @property
    def file_stem(self) -> str:
        """Its certificate's and key's file name, less the suffix (a file name has no `:`)."""
        return self.common_name.replace(":", "-")

    @property
    def server_name(self) -> str:
        """The name a client checks on this holder's certificate when it serves."""
        return f"{self.site}.sites.{DOMAIN}" if self.role is Role.SITE else f"{self.role.value}.{DOMAIN}"

    @classmethod
    def from_common_name(cls, name: str) -> Identity:
        role, _, site = name.partition(":")
        try:
            identity = cls(Role(role), site)
        except ValueError:
            raise PkiError(f"{name!r} names no role of this federation") from None
        if (identity.role is Role.SITE) != bool(site):
            raise PkiError(f"{name!r}: a site's certificate names its site, and only a site's does")
        return identity

    def __str__(self) -> str:
        return self.common_name


# The identities that are not a site's: what a scheduler's certificate must say, whatever address
# is dialled, and who gateways and operators are.
SCHEDULER, GATEWAY, OPERATOR = Identity(Role.SCHEDULER), Identity(Role.GATEWAY), Identity(Role.OPERATOR)


@dataclass(frozen=True, slots=True)
class Credentials:
    """One holder's PEM material: the CA's certificate, its own certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes


def _write(path: Path, data: bytes, private: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if private:
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_TRUNC


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def init_ca(directory: Path) -> Path:
    """A new CA in `directory` (refused if one is there: reissuing would orphan every certificate)."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_KEY).exists():
        raise PkiError(f"{directory / CA_KEY} exists: this directory already holds a CA")
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("inference-federation CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    _write(directory / CA_KEY, key.private_bytes(*_PRIVATE), private=True)
    _write(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return directory


_PRIVATE = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def issue(ca_dir: Path, identity: Identity, out_dir: Path, hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A certificate and key for `identity`, signed by the CA in `ca_dir`, written to `out_dir`
    as NAME.crt / NAME.key (NAME: the common name, `:` as `-`). `hosts` are extra names or
    addresses it may be reached at (besides its server name)."""
    try:
        ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
    except (OSError, ValueError) as exc:
        raise PkiError(f"no usable CA in {ca_dir}: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{ca_dir / CA_KEY} is not this federation's kind of CA key")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(identity.server_name)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(identity.common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CERT_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{identity.file_stem}.crt", out_dir / f"{identity.file_stem}.key"
    _write(key_path, key.private_bytes(*_PRIVATE), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return cert_path, key_path


def load(ca_cert: Path, cert: Path, key: Path) -> Credentials:
    """A holder's credentials from files; PkiError naming the file that is missing or open to others."""
    for path in (ca_cert, cert, key):
        if not path.is_file():
            raise PkiError(f"{path}: no such file")
    if key.stat().st_mode & 0o077:
        raise PkiError(f"{key}: a private key must be readable by its owner only (chmod 600)")
    return Credentials(ca_cert.read_bytes(), cert.read_bytes(), key.read_bytes())


def holder(cert_pem: bytes) -> Identity:
    """Who a certificate names (PkiError when it names no role of ours)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise PkiError(f"not a PEM certificate: {exc}") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise PkiError("a certificate of this federation has exactly one common name")
    return Identity.from_common_name(str(names[0].value))


def signed_by(ca_pem: bytes, cert_pem: bytes) -> bool:
    """Whether the CA certificate's key signed this certificate (False for anything unreadable)."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
