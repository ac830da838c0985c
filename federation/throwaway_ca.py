"""A federation CA made for one run of the embedded federation, so that `fedctl up` stays one
command and still speaks mutual TLS on every gRPC hop, as a federation across the internet must.

Its directory is readable by its user only, and goes with the run. Each process gets its own
certificate (the schedulers `scheduler`, each agent `site:NAME`, the gateways `gateway`), and
the run's `fedctl` commands an `operator` one. `fedctl up` keeps it where `fedctl status` and
`fedctl site ...` on the same machine find it (`control.tls_dir`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from core import pki
from core.mtls import Tls, load_tls
from core.pki import OPERATOR, Identity


class ThrowawayCa:
    def __init__(self, directory: Path, host: str) -> None:
        """A new CA in `directory` (made, or emptied, for it; mode 0700); certificates name `host`
        as an address their holders serve at."""
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(mode=0o700, parents=True)
        self.directory = pki.init_ca(directory)
        self._host = host
        self._issued: dict[Identity, tuple[Path, Path]] = {}
        self.operator = self.tls(OPERATOR)

    def _files(self, identity: Identity) -> tuple[Path, Path]:
        if identity not in self._issued:
            self._issued[identity] = pki.issue(self.directory, identity, self.directory, (self._host,))
        return self._issued[identity]

    def flags(self, identity: Identity) -> list[str]:
        """The command-line flags a process serving or calling as `identity` is started with."""
        cert, key = self._files(identity)
        return ["--ca", str(self.directory / pki.CA_CERT), "--cert", str(cert), "--key", str(key)]

    def tls(self, identity: Identity) -> Tls:
        cert, key = self._files(identity)
        return load_tls(self.directory / pki.CA_CERT, cert, key, identity)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def operator_tls(directory: Path) -> Tls | None:
    """The operator's credentials a running `fedctl up` keeps in `directory`; None if it has none."""
    cert = directory / f"{OPERATOR.common_name}.crt"
    if not cert.is_file():
        return None
    return load_tls(directory / pki.CA_CERT, cert, directory / f"{OPERATOR.common_name}.key", OPERATOR)
