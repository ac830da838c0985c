"""Every launch recipe's command line is one that SGLang's own `launch_server` parser accepts, with
the values the agent meant: the built-in one-worker-per-GPU recipes (core.recipes.DEFAULT_RECIPES)
sgl-cookbook's TP8 ones (deploy/recipes-tp8.yaml) and the tier-ordering ones (deploy/recipes-tiers.yaml).

The parser is SGLang 0.5.23's (`ServerArgs.add_cli_args`), installed without its GPU stack by
scripts/install-sglang; .ci/run installs it, and under CI a missing SGLang fails these tests
instead of skipping them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import shlex

import pytest

from core.processes import PROJECT_ROOT
from core.recipes import DEFAULT_RECIPES, Recipe, command_line, load_recipes, worker_env

MODEL = "openai/gpt-oss-120b"  # the federation's served model name
HOST, PORT = "0.0.0.0", 30123  # not SGLang's defaults (127.0.0.1, 30000), so they must come from the command line
TP8 = load_recipes(PROJECT_ROOT / "deploy" / "recipes-tp8.yaml")
TIERS = load_recipes(PROJECT_ROOT / "deploy" / "recipes-tiers.yaml")

# What each recipe must start, written out here rather than read back from the recipe: the
# checkpoint, the tensor-parallel size, and the quantization SGLang applies at load (None: the
# checkpoint's own format; MI300X at TP1 fits the bf16 checkpoint only quantized to FP8).
EXPECTED = {
    "builtin-mi300x": (DEFAULT_RECIPES["mi300x"], "lmsys/gpt-oss-120b-bf16", 1, "fp8"),
    "builtin-mi355x": (DEFAULT_RECIPES["mi355x"], "openai/gpt-oss-120b", 1, None),
    "tp8-mi300x": (TP8["mi300x"], "lmsys/gpt-oss-120b-bf16", 8, None),
    "tp8-mi355x": (TP8["mi355x"], "openai/gpt-oss-120b", 8, None),
    "tiers-mi300x": (TIERS["mi300x"], "lmsys/gpt-oss-120b-bf16", 1, "fp8"),
    "tiers-mi355x": (TIERS["mi355x"], "openai/gpt-oss-120b", 1, None),
}


@pytest.fixture(scope="module")
def server_args():
    """SGLang's launch_server arguments (`sglang.srt.server_args`)."""
    if importlib.util.find_spec("sglang") is None:
        message = "needs SGLang's code (scripts/install-sglang)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run this test: {message}", pytrace=False)
        pytest.skip(message)
    return importlib.import_module("sglang.srt.server_args")  # installed but not importable: an error, not a skip


def launch_server_parses(server_args, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as `python -m sglang.launch_server` parses it; a refusal (an unknown flag,
    a bad value: argparse exits) fails the test with argparse's own message."""
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    server_args.ServerArgs.add_cli_args(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        refusal = stderr.getvalue().strip().splitlines()[-1]  # after the usage text
    pytest.fail(f"launch_server refuses `{shlex.join(argv)}`: {refusal}", pytrace=False)


def check_recipe(server_args, recipe: Recipe, model_path: str, tp: int, quantization: str | None) -> None:
    parsed = launch_server_parses(server_args, command_line(recipe, MODEL, HOST, PORT))
    assert parsed.model_path == model_path
    assert parsed.tp_size == tp
    assert parsed.quantization == quantization
    assert (parsed.host, parsed.port) == (HOST, PORT)
    assert parsed.served_model_name == MODEL
    assert parsed.tokenizer_path == (recipe.tokenizer_path or MODEL)
    assert parsed.stream_interval == recipe.stream_interval
    assert parsed.enable_metrics is True  # the agent reads each worker's load from /metrics
    assert parsed.incremental_streaming_output is True  # the agent reads deltas


@pytest.mark.parametrize("name", EXPECTED)
def test_launch_server_accepts_the_recipe(server_args, name: str) -> None:
    """The recipe's command line parses with SGLang's parser into the checkpoint, TP size and
    quantization the recipe is for, on the host and port the agent chose, with the federation's
    model and tokenizer names, metrics on and incremental streaming."""
    check_recipe(server_args, *EXPECTED[name])


def test_recipe_fields_reach_sglang(server_args) -> None:
    """Fields left at SGLang's defaults in the recipes above (stream interval 1, the tokenizer
    named after the model) are still passed through when a recipe sets them."""
    recipe = DEFAULT_RECIPES["mi355x"].model_copy(
        update={"stream_interval": 4, "tokenizer_path": "/models/o200k-harmony", "tp": 2, "gpus_per_worker": 2}
    )
    check_recipe(server_args, recipe, "openai/gpt-oss-120b", 2, None)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (("--quantisation", "fp8"), "unrecognized arguments: --quantisation fp8"),
        (("--attention-backend", "aiterr"), "argument --attention-backend: invalid choice: 'aiterr'"),
    ],
    ids=["misspelt-flag", "bad-choice"],
)
def test_a_recipe_sglang_would_refuse_is_reported(server_args, args: tuple[str, ...], refusal: str) -> None:
    """The check above can fail: a recipe with a flag SGLang does not know, or a value it does not
    take, is reported with SGLang's refusal."""
    recipe = DEFAULT_RECIPES["mi300x"].model_copy(update={"args": args})
    with pytest.raises(pytest.fail.Exception, match=refusal):
        check_recipe(server_args, recipe, "lmsys/gpt-oss-120b-bf16", 1, None)


def test_tp8_recipes_take_a_whole_node() -> None:
    """deploy/recipes-tp8.yaml: a 16-GPU site of either type runs two workers, each on its own 8
    GPUs, with aiter off as the cookbook says."""
    for gpu in ("mi300x", "mi355x"):
        recipe = TP8[gpu]
        assert recipe.workers(16) == 2
        envs = [worker_env(recipe, worker, {}) for worker in range(2)]
        assert [e["HIP_VISIBLE_DEVICES"] for e in envs] == ["0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14,15"]
        # an agent given the host's GPUs from 8 on (--first-gpu): its one worker takes those
        assert worker_env(recipe, 0, {}, first_gpu=8)["HIP_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
        assert all(e["SGLANG_USE_AITER"] == "0" for e in envs)


def test_the_tier_recipes_trade_lpm_for_sglangs_priority_order(server_args) -> None:
    """deploy/recipes-tiers.yaml: SGLang parses its workers into fcfs with priority scheduling
    (the only policies it allows it with), and the emulator, which starts from the same command
    line, takes it too, SGLang's priority preemption on in both."""
    from nodes.emulator.__main__ import parse_args as emulator_args

    for gpu in ("mi300x", "mi355x"):
        argv = command_line(TIERS[gpu], MODEL, HOST, PORT)
        parsed = launch_server_parses(server_args, argv)
        assert parsed.schedule_policy == "fcfs" and parsed.enable_priority_scheduling
        emulated = emulator_args([*argv, "--profile", gpu])
        assert emulated.schedule_policy == "fcfs" and emulated.enable_priority_scheduling
        assert not parsed.disable_priority_preemption and not emulated.disable_priority_preemption
