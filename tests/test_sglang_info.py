"""SGLang's information shapes (core/sglang_info.py) as plain values: /v1/loads' query read as
SGLang reads it (and stricter where SGLang ignores), additions kept beside SGLang's keys, and
the same keys as the emulated SGLang worker answers with."""

from __future__ import annotations

import aiohttp
import pytest
from multidict import MultiDict

from core import sglang_info
from core.errors import BadRequest
from core.sglang_info import Load, LoadsQuery, ServerArgs
from nodes.emulator.launch import EmulatorProcess

ARGS = ServerArgs(model_path="openai/gpt-oss-120b", served_model_name="openai/gpt-oss-120b", tokenizer_path="t")


def test_the_loads_query_is_read_as_sglang_reads_it() -> None:
    """No query: every rank, every section, JSON. `include` is comma-separated with spaces
    allowed, `dp_rank` an integer (negative ones pick nothing, as SGLang)."""
    assert sglang_info.loads_query(MultiDict()) == LoadsQuery(None, frozenset({"all"}), "json")
    query = sglang_info.loads_query(MultiDict(dp_rank="-1", include="core, queues", format="prometheus"))
    assert query == LoadsQuery(-1, frozenset({"core", "queues"}), "prometheus")


@pytest.mark.parametrize(
    ("pairs", "param"),
    [
        ([("include", "core,gpu")], "include"),
        ([("dp_rank", "1.5")], "dp_rank"),
        ([("format", "yaml")], "format"),
        ([("rank", "0")], "rank"),
        ([("include", "core"), ("include", "all")], "include"),
    ],
)
def test_a_loads_query_sglang_would_refuse_or_ignore_is_a_400(pairs, param) -> None:
    """An unknown section or a dp_rank that is not an integer (SGLang: 400), an unknown
    parameter or format or a repeated parameter (SGLang: ignored) are each a BadRequest naming
    the parameter."""
    with pytest.raises(BadRequest) as refused:
        sglang_info.loads_query(MultiDict(pairs))
    assert refused.value.param == param and refused.value.status == 400


def test_additions_go_beside_sglangs_keys_never_in_their_place() -> None:
    """A server's own keys follow SGLang's; one that would replace SGLang's is a bug, raised."""
    body = sglang_info.server_info(
        ARGS, max_total_num_tokens=10, max_req_input_len=4, internal_states=[], extra={"federation": {}}
    )
    assert list(body)[-2:] == ["version", "federation"] and body["max_total_num_tokens"] == 10
    with pytest.raises(ValueError, match="'version' is SGLang's key"):
        sglang_info.server_info(
            ARGS, max_total_num_tokens=1, max_req_input_len=1, internal_states=[], extra={"version": "x"}
        )
    with pytest.raises(ValueError, match="'dp_rank'"):
        Load(0, 0.0, extra={"dp_rank": 1}).as_dict()


def test_max_req_input_len_is_sglangs() -> None:
    """min(context - 1, KV pool - 1) less SGLang's reserve of 5; the context alone when the pool
    is not known."""
    assert sglang_info.max_req_input_len(131_072, 3_060_000) == 131_066
    assert sglang_info.max_req_input_len(131_072, 1_000) == 994
    assert sglang_info.max_req_input_len(131_072, 0) == 131_066


def test_a_load_rounds_as_sglang_and_says_itself_in_prometheus() -> None:
    """Fractions rounded as SGLang rounds them; the Prometheus form one gauge per field, by rank."""
    load = Load(
        timestamp=1.0, dp_rank=3, num_running_reqs=2, token_usage=0.123456, gen_throughput=10.005, utilization=2 / 3
    )
    body = load.as_dict()
    assert body["token_usage"] == 0.1235 and body["utilization"] == 0.6667 and body["dp_rank"] == 3
    text = sglang_info.loads_prometheus([load])
    assert '# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="3"} 2\n' in text
    assert "sglang_decode_moments" not in text  # not a number: SGLang leaves it out too


def test_a_client_reads_what_a_server_info_says_and_nothing_of_the_wrong_type() -> None:
    """The agent's reading of a worker's /server_info: SGLang's effective limit per DP rank times
    its ranks, else the server argument; a field of the wrong type is as if it were not there."""
    body = {
        "model_path": "openai/gpt-oss-120b",
        "tp_size": True,  # a bool is not a size
        "incremental_streaming_output": "yes",  # nor is a string a flag
        "enable_mixed_chunk": True,
        "dp_size": 2,
        "max_running_requests": 9,
        "internal_states": [{"effective_max_running_requests_per_dp": 48}],
    }
    args = ServerArgs.read(body)
    assert (args.model_path, args.served_model_name, args.tp_size) == ("openai/gpt-oss-120b", "", 1)
    assert (args.incremental_streaming_output, args.enable_mixed_chunk) == (False, True)
    assert sglang_info.max_running_requests(body) == 96
    assert sglang_info.max_running_requests({"max_running_requests": 9}) == 9
    assert sglang_info.max_running_requests({"max_running_requests": None, "internal_states": "x"}) is None


async def test_the_same_keys_as_the_emulated_worker(mi355x: EmulatorProcess) -> None:
    """/model_info has the emulated SGLang worker's keys, and a load's core section is among its
    load's: the emulator and the gateway describe SGLang alike."""
    async with aiohttp.ClientSession() as http:
        async with http.get(mi355x.urls[0] + "/model_info") as resp:
            worker_model = await resp.json()
        async with http.get(mi355x.urls[0] + "/v1/loads") as resp:
            worker_load = (await resp.json())["loads"][0]
    assert sglang_info.model_info(ARGS).keys() == worker_model.keys()
    assert Load(timestamp=0.0, dp_rank=0).as_dict().keys() == worker_load.keys()
