"""The generated gRPC modules match federation.proto."""

from proto.regenerate import stale_files


def test_generated_modules_are_fresh() -> None:
    """Regenerating from the .proto gives exactly the committed modules (run
    `python3 -m proto.regenerate` after changing the contract)."""
    assert stale_files() == []
