"""Across sites, a conversation goes on where its history is cached, and moves when that site
dies, with exact usage (core/prefixes.py, core/policy.py); the openai client sees the cached
part of its prompt in its usage."""

from __future__ import annotations

import signal

import openai
import pytest

from core import tokens
from tests.conftest import SITES
from tests.test_federation import MODEL

QUESTIONS = ["Tell me about rivers.", "And about lakes?", "Which is deeper?"]


async def _turn(client: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, str, openai.types.CompletionUsage]:
    """One turn of the conversation: the site that answered, the answer, its usage."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=60, extra_body={"ignore_eos": True}
    )
    reply = raw.parse()
    assert reply.usage is not None
    return raw.headers["x-federation-site"], reply.choices[0].message.content or "", reply.usage


@pytest.mark.timeout(180)
async def test_a_conversation_stays_where_its_history_is_and_moves_when_that_site_dies(make_federation) -> None:
    """A conversation opening with a long system prompt: every turn after the first lands at the
    first turn's site (its history is cached there), though no WAN term binds it (its client says
    no region), and the site's prefix cache answers for most of each later prompt. That site is
    killed: the next turn goes to the other site, answered whole, with exact usage."""
    fed, _ = make_federation(speed=1)
    system = "You are a patient geography tutor. " * 120  # ~840 tokens: 13 blocks of 64
    messages: list[dict] = [{"role": "system", "content": system}]
    async with openai.AsyncOpenAI(base_url=fed.config.gateway_url + "/v1", api_key="unused", max_retries=0) as client:
        sites = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            site, answer, usage = await _turn(client, messages)
            messages.append({"role": "assistant", "content": answer})
            sites.append(site)
            if len(sites) > 1:
                assert usage.prompt_tokens_details is not None
                assert usage.prompt_tokens_details.cached_tokens > 0.8 * len(tokens.encode(system)), usage
        assert len(set(sites)) == 1, sites
        fed.child(f"agent {sites[0]}").proc.send_signal(signal.SIGKILL)
        messages.append({"role": "user", "content": "Thank you."})
        site, answer, usage = await _turn(client, messages)
    other = next(name for name, _, _ in SITES if name != sites[0])
    assert site == other and answer and usage.completion_tokens == 60, (site, usage)
