"""Where a prompt's prefix is likely cached, known by hashes only (core/prefixes.py), and the
policy that sends a request there unless another site starts it sooner by more than the
re-prefill costs (core/policy.py)."""

from __future__ import annotations

import resource

from hypothesis import given, settings
from hypothesis import strategies as st

from core.policy import RouteContext, SiteLoad, least_expected_delay
from core.prefixes import BLOCK_TOKENS, PrefixDirectory, prefix_hashes
from core.wire import RouteRequest

SYSTEM = list(range(1000, 1000 + 2048))  # a 2,048-token system prompt: 32 blocks


def test_equal_prefixes_have_equal_hashes_and_only_whole_blocks_count() -> None:
    """Two prompts sharing a system prompt share its blocks' hashes and none after; a partial last
    block is not hashed; a key changes every hash (a hash is no use without it)."""
    a, b = prefix_hashes(SYSTEM + [1, 2, 3] * 30), prefix_hashes(SYSTEM + [4, 5, 6] * 30)
    assert len(a) == len(b) == (2048 + 90) // BLOCK_TOKENS
    assert a[:32] == b[:32] and a[32] != b[32]
    assert prefix_hashes(SYSTEM[:63]) == ()
    assert not set(prefix_hashes(SYSTEM, key=b"federation secret")) & set(prefix_hashes(SYSTEM))
    # A block's hash covers every block before it: the same block after another prefix differs.
    assert prefix_hashes(SYSTEM[64:128]) != prefix_hashes(SYSTEM[:128])[1:]


def test_the_directory_says_how_much_of_a_prefix_each_place_holds() -> None:
    """A site sent a request with the system prompt and a question holds the system prompt and
    that question's blocks; a new question after the same system prompt finds its 2,048 tokens
    there and nothing at a site never sent it; a site that went down holds nothing."""
    directory = PrefixDirectory()
    directory.record("us", prefix_hashes(SYSTEM + [7] * 200))
    asked = prefix_hashes(SYSTEM + [8] * 200)
    assert directory.cached_tokens(["us", "kr"], asked) == {"us": 2048, "kr": 0}
    directory.forget("us")
    assert directory.cached_tokens(["us"], asked) == {"us": 0}


_PLACES = st.sampled_from(["us", "kr", "eu"])
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("record"), _PLACES, st.lists(st.integers(0, 5), max_size=4)),
        st.tuples(st.just("forget"), _PLACES, st.just([])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_STEPS, st.lists(st.integers(0, 5), max_size=4))
def test_the_directory_answers_as_a_plain_list_of_what_was_sent_where(steps, asked) -> None:
    """Against the plainest model (every (place, hash) sent, least recent first, cut to the bound,
    a forgotten place's removed): the same entries, and the same holders of any prefix, whichever
    way a hash's places are kept (one place or several)."""
    directory, model = PrefixDirectory(max_entries=6), []
    for op, place, hashes in steps:
        if op == "record":
            directory.record(place, hashes)
            for h in hashes:
                if (place, h) in model:
                    model.remove((place, h))
                model.append((place, h))
            del model[: max(0, len(model) - 6)]
        else:
            directory.forget(place)
            model = [(p, h) for p, h in model if p != place]
    assert len(directory) == len(model)
    expected = {}
    for place in {p for p, _ in model}:
        run = 0
        while run < len(asked) and (place, asked[run]) in model:
            run += 1
        if run:
            expected[place] = run * BLOCK_TOKENS
    assert directory.holders(asked) == expected


def test_the_directory_stays_within_its_bound_under_a_flood_of_distinct_prefixes() -> None:
    """100,000 requests of distinct 1,024-token prompts (1.6 M blocks) leave at most its bound of
    entries and a few tens of MB more memory (32 MB from a fresh process: ~460 bytes an entry,
    and what the flood's own tuples leave behind); the most recent prefixes are the ones kept."""
    directory = PrefixDirectory(max_entries=50_000)
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    last = ()
    for i in range(100_000):
        last = tuple(hash((i, j)) & 0xFFFF_FFFF_FFFF_FFFF for j in range(16))  # as prefix_hashes gives
        directory.record(f"site{i % 7}", last)
    assert len(directory) == 50_000
    assert directory.cached_tokens([f"site{99_999 % 7}"], last) == {f"site{99_999 % 7}": 16 * BLOCK_TOKENS}
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024
    assert grown_mb < 40, grown_mb


def _site(name: str, outstanding_requests: int) -> SiteLoad:
    """A site of 1,000 slots delivering 100 k tok/s, prefilling at 10 µs a token (MI355X-like)."""
    return SiteLoad(
        name,
        "r",
        name + ":1",
        capacity_tok_s=100_000.0,
        outstanding_tokens=outstanding_requests * 200,
        outstanding_requests=outstanding_requests,
        slots=1000,
        prefill_s_per_token=1e-5,
    )


def test_a_request_goes_where_its_prefix_is_unless_another_site_starts_it_sooner_by_more() -> None:
    """A 20,000-token conversation whose history site `a` holds: with both sites about as loaded,
    it goes to `a` (0.2 s of prefill saved there); with `a` much fuller, or both full and `a` so
    queued that the request would start there later by more than that, to `b`."""
    req = RouteRequest("r", prompt_tokens=20_000, max_tokens=200)
    cached = RouteContext({}, 0, {"a": 19_968})
    assert least_expected_delay([_site("a", 500), _site("b", 500)], req, cached).site == "a"
    assert least_expected_delay([_site("a", 500), _site("b", 480)], req, RouteContext({}, 0)).site == "b"
    # a fuller than b by 20 % of its slots, with free slots: the hit still keeps it there.
    assert least_expected_delay([_site("a", 700), _site("b", 500)], req, cached).site == "a"
    assert least_expected_delay([_site("a", 700), _site("b", 500)], req, RouteContext({}, 0)).site == "b"
    # a fuller by 40 %: balance first, as the sglang-router does.
    assert least_expected_delay([_site("a", 900), _site("b", 500)], req, cached).site == "b"
    # b full, one ahead of this request: it starts there in 2 ms, and prefills it all (0.2 s).
    assert least_expected_delay([_site("a", 1050), _site("b", 1000)], req, cached).site == "a"  # 51 ahead: 0.1 s
    assert least_expected_delay([_site("a", 1150), _site("b", 1000)], req, cached).site == "b"  # 151 ahead: 0.3 s


def _arrive_together(prompt_tokens: int, cached: int, n: int = 400) -> dict[str, int]:
    """Requests routed one after another with none finishing; `a` held the prefix first, and a
    site holds it once it was sent one."""
    req = RouteRequest("r", prompt_tokens=prompt_tokens, max_tokens=200)
    load, holders = {"a": 1, "b": 0}, {"a"}
    for _ in range(n):
        ctx = RouteContext({}, 0, {name: cached for name in holders})
        chosen = least_expected_delay([_site(name, k) for name, k in load.items()], req, ctx).site
        load[chosen] += 1
        holders.add(chosen)
    return load


def test_a_prefix_every_prompt_shares_does_not_pull_all_work_to_one_site() -> None:
    """A chat template's header (64 tokens every prompt shares), held by `a`, saves too little
    to outweigh a fuller batch: of 400 requests arriving together, idle `b` takes half, within a
    few. A 2,000-token system prompt `a` alone held keeps work at `a` until `a` is a quarter
    of its slots fuller; then `b` is sent one, holds it too, and the two stay that close."""
    header = _arrive_together(prompt_tokens=70, cached=64)
    assert abs(header["a"] - header["b"]) <= 2
    system = _arrive_together(prompt_tokens=2_100, cached=2_048)
    assert system["b"] > 0 and abs(system["a"] - system["b"]) <= 0.25 * 1000 + 1
