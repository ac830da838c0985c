"""`fedctl bench --workload multi-turn`: conversations whose history grows, turn after turn.

Each conversation opens with a prompt of its own (a system prompt and a first question), and
each later turn asks its next question after the whole conversation so far: every earlier
prompt and answer, as a chat client resends them. Between turns the user thinks. So each turn
but the first finds its history cached wherever the conversation's previous turn ran, and
nowhere else: sprayed across sites and workers, every turn re-prefills its whole history.

Two pacings. By default (Offline) every conversation is its own user, who thinks THINK_S
between an answer and the next question: all of them at once, the federation saturated. With
a rate (`--scenario server --rate R`), SGLang's own multi-turn benchmark's pacing: turns leave
at a Poisson rate, each taken at random from the conversations whose previous answer has come
back, at most MAX_PARALLEL open; the load is what the rate says, not what the endpoint can take.

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
MAX_PARALLEL = 128  # paced by a rate: turns open at most (bench_multiturn.py's --max-parallel)


@dataclass(frozen=True, slots=True)
class Conversations:
    conversations: int = CONVERSATIONS
    turns: int = TURNS
    opening_tokens: int = OPENING_TOKENS
    question_tokens: int = QUESTION_TOKENS
    answer_tokens: int = ANSWER_TOKENS
    think_s: float = THINK_S
    seed: int = 0
    rate: float | None = None  # turns/s (GPU time) drawn from the ready conversations; None: users think


def run(endpoint: str, spec: Conversations, speed: float, label: str) -> list[list[Result]]:
    """Every conversation to its end; each one's turns' results, in order."""
    return uvloop.run(_run(endpoint, spec, speed, label))


class _Conversation:
    """One conversation's history so far and the results of its turns."""

    def __init__(self, index: int, opening: str, questions: list[str], spec: Conversations) -> None:
        self.index, self.questions, self.spec = index, questions, spec
        self.history, self.tokens_so_far = opening, spec.opening_tokens
        self.results: list[Result] = []

    def next_turn(self) -> Sample:
        turn = len(self.results)
        return Sample(self.index * self.spec.turns + turn, self.history, self.tokens_so_far, self.spec.answer_tokens)

    def answered(self, result: Result) -> bool:
        """Takes the turn's result; whether the conversation goes on (a failed turn ends it)."""
        self.results.append(result)
        turn = len(self.results) - 1
        if not result.ok or turn == self.spec.turns - 1:
            return False
        self.history += result.text + self.questions[turn]
        self.tokens_so_far += result.output_tokens + self.spec.question_tokens
        return True


async def _run(endpoint: str, spec: Conversations, speed: float, label: str) -> list[list[Result]]:
    rng = random.Random(spec.seed)
    synth = tokens.synthetic_text()

    def words(n: int) -> str:
        return synth.window(rng.randrange(synth.period), n)[0]

    chats = [
        _Conversation(i, words(spec.opening_tokens), [words(spec.question_tokens) for _ in range(spec.turns - 1)], spec)
        for i in range(spec.conversations)
    ]
    async with session(endpoint) as http:
        model = await served_model(http, endpoint)
        with tqdm(total=spec.conversations * spec.turns, desc=label, unit="turn", mininterval=2.0) as bar:

            async def turn(chat: _Conversation) -> bool:
                result = await send(http, endpoint, model, chat.next_turn(), keep_text=True)
                bar.update()
                return chat.answered(result)

            if spec.rate is None:
                await asyncio.gather(*(_think_between(chat, turn, rng, spec.think_s / speed) for chat in chats))
            else:
                await _paced(chats, turn, rng, spec.rate * speed)
    return [chat.results for chat in chats]


async def _think_between(chat: _Conversation, turn, rng: random.Random, think_wall_s: float) -> None:
    """A user: the first question within one think time (not all at once), then one a think time
    after each answer."""
    await asyncio.sleep(rng.random() * think_wall_s)
    for _ in range(chat.spec.turns):
        if not await turn(chat):
            return
        await asyncio.sleep(think_wall_s)


async def _paced(chats: list[_Conversation], turn, rng: random.Random, wall_rate: float) -> None:
    """bench_multiturn.py's sender: a turn at Poisson intervals, from a ready conversation taken at
    random (waiting for one when none is ready or MAX_PARALLEL are open)."""
    ready, changed = list(chats), asyncio.Event()
    open_turns: set[asyncio.Task[None]] = set()

    async def one(chat: _Conversation) -> None:
        try:
            if await turn(chat):
                ready.append(chat)
        finally:
            open_turns.discard(asyncio.current_task())
            changed.set()

    while ready or open_turns:
        if not ready or len(open_turns) >= MAX_PARALLEL:
            changed.clear()
            await changed.wait()
            continue
        open_turns.add(asyncio.create_task(one(ready.pop(rng.randrange(len(ready))))))
        await asyncio.sleep(rng.expovariate(wall_rate))


def affinity(conversations: list[list[Result]]) -> float | None:
    """Of the turns after each conversation's first, the share served at its previous turn's site
    (None when the endpoint said no sites)."""
    pairs = [(a.site, b.site) for turns in conversations for a, b in itertools.pairwise(turns)]
    known = [(a, b) for a, b in pairs if a and b]
    return round(sum(a == b for a, b in known) / len(known), 4) if known else None
