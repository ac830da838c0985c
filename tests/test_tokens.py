"""Prompt counting and synthetic output are exact in o200k tokens."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_compiled_tokenizer_agrees_with_harmony_and_loads_alone() -> None:
    """bpe-openai's compiled tokenizer, loaded without its Python wrapper (whose import costs every
    emulated worker and gateway ~1.2 s), gives openai-harmony's ids (another implementation of the
    same BPE) and the bytes each id stands for; a lone surrogate, which JSON allows, is U+FFFD; a
    text past the 200 k tokens bpe-openai takes at once is refused."""
    probe = "import sys; from core import tokens; tokens.count('warm up'); print('bpe_openai' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    assert loaded.stdout.strip() == "False"
    rng = random.Random(5)
    words = ["Hello,", "world!", "naïve", "café", "東京", "😀", "def", "f(x):", "\n", "  ", "<|end", "1234567"]
    for _ in range(50):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        ids = tokens.encode_ordinary(text)
        assert ids == harmony.encode(text)
        assert b"".join(tokens.token_bytes(t) for t in ids) == text.encode()
    assert tokens.encode_ordinary("a\ud800b") == tokens.encode_ordinary("a\ufffdb")
    with pytest.raises(tokens.PromptTooLong):
        tokens.encode("💥 " * 300_000)  # 600 k characters, 600 k tokens
    with pytest.raises(KeyError):
        tokens.token_bytes(200_010)  # past o200k_base, not a Harmony special


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
