"""How much work a request is, in output tokens: the unit of capacity and of the ledgers."""

from __future__ import annotations

# Expected answer length when a request sets no lower limit: MLPerf gpt-oss-120b's mean output.
DEFAULT_EXPECTED_OUTPUT_TOKENS = 1278


def expected_output_tokens(max_tokens: int) -> int:
    """The tokens a request will probably produce; `max_tokens` 0 means no limit was given."""
    return min(max_tokens, DEFAULT_EXPECTED_OUTPUT_TOKENS) if max_tokens > 0 else DEFAULT_EXPECTED_OUTPUT_TOKENS
