"""`python3 -m proto.regenerate`: rebuild federation_pb2*.py beside federation.proto.

The generated modules are committed so that a plain install runs without grpcio-tools;
tests/test_proto_fresh.py fails when they no longer match the .proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
GENERATED = ("federation_pb2.py", "federation_pb2.pyi", "federation_pb2_grpc.py")


def generate(out_root: Path) -> None:
    """Write the generated modules under `out_root/proto/`."""
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(PROTO_DIR / "federation.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def stale_files() -> list[str]:
    """Generated files that differ from what the .proto gives now."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name for name in GENERATED if (Path(tmp) / "proto" / name).read_bytes() != (PROTO_DIR / name).read_bytes()
        ]


if __name__ == "__main__":
    generate(ROOT)
    print("regenerated: " + ", ".join(GENERATED))
    sys.exit(0)
