"""`fedctl bench --workload multi-turn`: conversations whose history grows, turn after turn.

Each conversation opens with a prompt of its own (a system prompt and a first question), and
each later turn asks its next question after the whole conversation so far: every earlier
prompt and answer, as a chat client resends them. Between turns the user thinks. So each turn
but the first finds its history cached wherever the conversation's previous turn ran, and
nowhere else: sprayed across sites and workers, every turn re-prefills its whole history.

Measured as `fedctl bench` measures a run (`scenarios.summarize`), plus `affinity`: of the
turns after a conversation's first, the share served at the site its previous turn was (an
endpoint that does not say its site, a peer's, has none).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass

import uvloop
from tqdm import tqdm

from core import tokens
from federation.bench.client import Result, send, served_model, session
from federation.bench.workload import Sample

# Defaults: SGLang's own multi-turn benchmark's (benchmark/hicache/bench_multiturn.py, the one
# its cache work is measured by: --num-clients 256, --num-rounds 5, --request-length 512 for the
# opening and for each later question, --output-length 64), the last turn 2,816 tokens long.
# Its clients wait in a queue of ready turns drawn at a Poisson rate; ours think between turns.
CONVERSATIONS = 256
TURNS = 5
OPENING_TOKENS = 512
QUESTION_TOKENS = 512
ANSWER_TOKENS = 64
THINK_S = 2.0  # GPU seconds between an answer and the next question


@dataclass(frozen=True, slots=True)
class Conversations:
    conversations: int = CONVERSATIONS
    turns: int = TURNS
    opening_tokens: int = OPENING_TOKENS
    question_tokens: int = QUESTION_TOKENS
    answer_tokens: int = ANSWER_TOKENS
    think_s: float = THINK_S
    seed: int = 0


def run(endpoint: str, spec: Conversations, speed: float, label: str) -> list[list[Result]]:
    """Every conversation to its end; each one's turns' results, in order."""
    return uvloop.run(_run(endpoint, spec, speed, label))


async def _run(endpoint: str, spec: Conversations, speed: float, label: str) -> list[list[Result]]:
    rng = random.Random(spec.seed)
    synth = tokens.synthetic_text()

    def words(n: int) -> str:
        return synth.window(rng.randrange(synth.period), n)[0]

    scripts = [
        (words(spec.opening_tokens), [words(spec.question_tokens) for _ in range(spec.turns - 1)])
        for _ in range(spec.conversations)
    ]
    async with session(endpoint) as http:
        model = await served_model(http, endpoint)
        with tqdm(total=spec.conversations * spec.turns, desc=label, unit="turn", mininterval=2.0) as bar:

            async def converse(index: int, opening: str, questions: list[str]) -> list[Result]:
                # Conversations begin over one think time, not all at once.
                await asyncio.sleep(rng.random() * spec.think_s / speed)
                history, tokens_so_far, results = opening, spec.opening_tokens, []
                for turn in range(spec.turns):
                    sample = Sample(index * spec.turns + turn, history, tokens_so_far, spec.answer_tokens)
                    result = await send(http, endpoint, model, sample, keep_text=True)
                    results.append(result)
                    bar.update()
                    if not result.ok or turn == spec.turns - 1:
                        break
                    await asyncio.sleep(spec.think_s / speed)
                    history += result.text + questions[turn]
                    tokens_so_far += result.output_tokens + spec.question_tokens
                return results

            conversations = await asyncio.gather(*(converse(i, o, q) for i, (o, q) in enumerate(scripts)))
    return list(conversations)


def affinity(conversations: list[list[Result]]) -> float | None:
    """Of the turns after each conversation's first, the share served at its previous turn's site
    (None when the endpoint said no sites)."""
    pairs = [(a.site, b.site) for turns in conversations for a, b in itertools.pairwise(turns)]
    known = [(a, b) for a, b in pairs if a and b]
    return round(sum(a == b for a, b in known) / len(known), 4) if known else None
