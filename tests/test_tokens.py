"""Prompt counting and synthetic output are exact in o200k tokens."""

from __future__ import annotations

import random

from core import harmony, tokens
from nodes.emulator.output import GenerateSpec, plan_output


def test_synthetic_windows_are_exact_tokens() -> None:
    """Every window of the synthetic stream, at any offset and length, re-tokenizes to its own ids,
    so each prefix a stream sends holds exactly the tokens it claims."""
    synth = tokens.synthetic_text()
    rng = random.Random(3)
    for _ in range(200):
        offset, n = rng.randrange(10**9), rng.randint(1, 3000)
        text, ids = synth.window(offset, n)
        assert len(ids) == n and tokens.encode(text) == ids


def test_harmony_specials_count_as_one_token() -> None:
    """Harmony control tokens count once each, as in o200k_harmony (the prompt rendered by
    openai-harmony, counted by our tokenizer)."""
    ids = harmony.render_chat([harmony.Turn("user", "hi")], [], reasoning_effort="medium", today="2026-12-02")
    rendered = harmony.encoding().decode_utf8(ids)
    assert tokens.encode(rendered) == ids
    assert rendered.startswith("<|start|>system<|message|>You are ChatGPT")
    assert rendered.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    ids = tokens.encode(rendered)
    assert ids[0] == tokens.HARMONY_SPECIALS["<|start|>"]
    assert ids.count(tokens.HARMONY_SPECIALS["<|start|>"]) == 3


def test_output_plan_limits_and_stops() -> None:
    """The plan respects max_new_tokens, ignore_eos, min_new_tokens and stop_token_ids."""
    synth = tokens.synthetic_text()
    spec = GenerateSpec(rid="a", prompt_tokens=10, max_new_tokens=50, ignore_eos=True, seed=1)
    plan = plan_output(spec, synth, mean_output_tokens=1278)
    assert plan.tokens == 50 and plan.finish_reason == {"type": "length", "length": 50}
    ids = plan.text_and_ids(synth, 50)[1]
    stop_id = ids[20]
    first = ids.index(stop_id)
    plan = plan_output(
        GenerateSpec(rid="a", prompt_tokens=10, max_new_tokens=50, ignore_eos=True, seed=1, stop_token_ids=(stop_id,)),
        synth,
        1278,
    )
    assert plan.tokens == first + 1 and plan.finish_reason == {"type": "stop", "matched": stop_id}
    short = plan_output(
        GenerateSpec(rid="a", prompt_tokens=10, max_new_tokens=5000, min_new_tokens=4000, seed=9), synth, 50
    )
    assert short.tokens >= 4000, "EOS never comes before min_new_tokens"


def test_the_synthetic_stream_is_built_once_per_machine(tmp_path, monkeypatch) -> None:
    """The first process to need the stream builds it and leaves it in the user's cache; the next
    reads the same stream from there; a damaged file is not read but built and written again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = tokens._build_synthetic(70_000)

    def fresh() -> tokens.SyntheticText:  # as a new process sees it
        tokens.synthetic_text.cache_clear()
        return tokens.synthetic_text(70_000)

    try:
        assert fresh() == built
        (cached,) = (tmp_path / "inference-federation").glob("synthetic-*.bin")
        assert fresh() == built and tokens._unpack(cached.read_bytes()) == built
        damaged = bytearray(cached.read_bytes())
        damaged[-1] ^= 0xFF
        cached.write_bytes(bytes(damaged))
        assert tokens._unpack(cached.read_bytes()) is None
        assert fresh() == built and tokens._unpack(cached.read_bytes()) == built
    finally:
        tokens.synthetic_text.cache_clear()
