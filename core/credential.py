"""The join credential on the wire: a site presents it to the schedulers (RegisterSite, Report),
and an operator presents it to an agent waiting to be joined (Join), as gRPC metadata
`authorization: Bearer <credential>`. Where none is set, anyone may call (one machine).

It reaches a process by a file only its user can read (`--join-token-file`), never by the
environment, which every child inherits and `/proc/PID/environ` shows to its user's tools."""

from __future__ import annotations

import argparse
import hmac
import os
import stat
from pathlib import Path

import grpc


class SecretFileError(ValueError):
    """A secret's file is missing, empty, or readable by others than its owner."""


def read_secret(path: Path) -> str:
    """The secret in `path` (surrounding whitespace dropped), from a file of mode 0600 or stricter."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise SecretFileError(f"{path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(f"{path}: readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if not text:
        raise SecretFileError(f"{path}: empty")
    return text


def write_secret(path: Path, secret: str) -> None:
    """`secret` into `path`, mode 0600 from the moment the file exists."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        help="a file (mode 0600) holding the join credential sites present in a plaintext (--insecure) "
        "federation; none: anyone may join",
    )


def from_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The credential `--join-token-file` holds ("" without one); exits 2 on a bad file."""
    if args.join_token_file is None:
        return ""
    try:
        return read_secret(args.join_token_file)
    except SecretFileError as exc:
        p.error(f"--join-token-file {exc}")


def bearer(credential: str) -> tuple[tuple[str, str], ...]:
    """What a call carries to present `credential` ("": nothing)."""
    return (("authorization", f"Bearer {credential}"),) if credential else ()


def presented(context: grpc.aio.ServicerContext, credential: str) -> bool:
    """The call carries `credential`, or none is required."""
    if not credential:
        return True
    given = dict(context.invocation_metadata()).get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {credential}".encode())
