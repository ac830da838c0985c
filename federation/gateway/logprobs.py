"""Log probabilities in the shapes clients ask for them: OpenAI chat's (`logprobs.content`, one
entry per answer token, with its text, bytes and the most likely alternatives), OpenAI
completions' (parallel lists), and SGLang's ([logprob, id, text] triples in meta_info). The sites
send each output token's log probability and, when asked, the most likely (id, logprob) pairs
at its position."""

from __future__ import annotations

from typing import Any

from core import tokens

Top = tuple[tuple[int, float], ...]


def _text(token: int) -> str:
    return tokens.token_bytes(token).decode(errors="replace")


def chat_entry(token: int, logprob: float, top: Top) -> dict[str, Any]:
    """One answer token as OpenAI chat's `logprobs.content[]` says it."""
    raw = tokens.token_bytes(token)
    return {
        "token": raw.decode(errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
        "top_logprobs": [{"token": _text(t), "logprob": lp, "bytes": list(tokens.token_bytes(t))} for t, lp in top],
    }


class CompletionLogprobs:
    """OpenAI completions' `logprobs`, built up chunk by chunk (text_offset counts characters)."""

    def __init__(self) -> None:
        self.offset = 0

    def add(self, ids: tuple[int, ...], logprobs: tuple[float, ...], top: tuple[Top, ...]) -> dict[str, Any]:
        texts = [_text(t) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{_text(t): lp for t, lp in position} for position in top] if top else None,
            "text_offset": offsets,
        }


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    tops = [p["top_logprobs"] for p in parts]
    return {
        "tokens": [t for p in parts for t in p["tokens"]],
        "token_logprobs": [lp for p in parts for lp in p["token_logprobs"]],
        "top_logprobs": [t for top in tops for t in top] if all(top is not None for top in tops) else None,
        "text_offset": [o for p in parts for o in p["text_offset"]],
    }


def sglang_triples(ids: list[int], logprobs: list[float], top: list[Top]) -> dict[str, Any]:
    """meta_info's output_token_logprobs and output_top_logprobs, as SGLang's /generate says them."""
    meta: dict[str, Any] = {"output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=False)]}
    if top:
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in position] for position in top]
    return meta
