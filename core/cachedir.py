"""Files computed once per machine and read by every process of ours that needs them.

They live in the user's cache directory, where no other user can write (a file elsewhere must
be checked against a pinned hash before it is trusted, as core/harmony.py checks its vocabulary).
Each file is written under a temporary name and renamed into place, because the processes that
need it start together and must never read one half written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def user_cache_dir() -> Path:
    """This project's directory in the user's cache (`$XDG_CACHE_HOME`, else `~/.cache`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inference-federation"


def write_atomically(path: Path, data: bytes) -> None:
    """`data` as `path`, all or nothing; OSError where it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)
