"""How a site of each GPU type starts its SGLang workers: the launch recipes.

A real site runs `python -m sglang.launch_server` once per worker, and what it passes differs
by GPU (REFERENCE.md §6): MI355X serves the MXFP4 checkpoint `openai/gpt-oss-120b` with aiter
on; MI300X has no MXFP4 kernels yet, so it serves the bf16 conversion quantized to FP8 at load,
with aiter off. The served model name and the tokenizer are the federation's on every site (the
schedulers refuse a site whose tokenizer differs): one model in two weight formats.

The agent (`--launch`) builds each worker's command line and environment from its GPU type's
recipe (`command_line`, `worker_env`); the emulator takes the same command line, so the
embedded federation starts its emulated workers exactly as a real site starts SGLang.
tests/test_recipes.py parses every recipe's command line with SGLang's own argument parser.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import pydantic
import yaml
from pydantic import ConfigDict, Field, Strict, StrictStr

from core.settings import describe

SGLANG = ("-m", "sglang.launch_server")  # after the Python interpreter
EMULATOR = ("-m", "nodes.emulator")  # takes SGLang's command line (nodes/emulator/__main__.py)
PROGRAMS = {"sglang": SGLANG, "emulator": EMULATOR}
# Flags the agent sets itself on every worker: a recipe that sets one too would be ambiguous.
AGENT_FLAGS = frozenset(
    {
        "--model-path",
        "--served-model-name",
        "--tokenizer-path",
        "--tp-size",
        "--tp",
        "--host",
        "--port",
        "--stream-interval",
        "--enable-metrics",
        "--incremental-streaming-output",
        "--enable-cache-report",
    }
)

_POSITIVE_INT = Annotated[int, Strict(), Field(ge=1)]


class RecipeError(ValueError):
    pass


class Recipe(pydantic.BaseModel):
    """One GPU type's SGLang workers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: StrictStr  # the checkpoint each worker loads (a Hugging Face id or a local path)
    weight_format: StrictStr  # what the site reports: mxfp4, fp8, bf16, ...
    tokenizer_path: StrictStr = ""  # "": the federation's model name (it must be the same at every site)
    tp: _POSITIVE_INT = 1  # tensor parallel size of one worker
    gpus_per_worker: _POSITIVE_INT = 1
    stream_interval: _POSITIVE_INT = 1  # SGLang's default: an event per decode step
    args: tuple[StrictStr, ...] = ()  # further launch_server flags, as on its command line
    env: dict[StrictStr, StrictStr] = {}  # e.g. SGLANG_USE_AITER
    image: StrictStr = ""  # the ROCm container image it runs in (deployments; the agent does not use it)
    load_timeout_s: Annotated[float, Strict(), Field(gt=0)] = 1800.0  # a model load may take this long

    @pydantic.model_validator(mode="after")
    def _coherent(self) -> Recipe:
        if self.tp > self.gpus_per_worker:
            raise ValueError(f"tp {self.tp} needs at least {self.tp} GPUs per worker, not {self.gpus_per_worker}")
        own = sorted({a.split("=", 1)[0] for a in self.args} & AGENT_FLAGS)
        if own:
            raise ValueError(f"args must not set {', '.join(own)}: the agent sets them from the recipe's fields")
        if "HIP_VISIBLE_DEVICES" in self.env:
            raise ValueError("env must not set HIP_VISIBLE_DEVICES: the agent gives each worker its own GPUs")
        return self

    def workers(self, gpus: int) -> int:
        """How many workers a site of `gpus` GPUs runs."""
        if gpus % self.gpus_per_worker:
            raise RecipeError(f"{gpus} GPUs do not split into workers of {self.gpus_per_worker}")
        return gpus // self.gpus_per_worker


# Per GPU, TP1, one worker per GPU: what the MLPerf entries ran and what the emulator's models
# are calibrated for (REFERENCE.md §3). sgl-cookbook's TP8 variants: deploy/recipes-tp8.yaml.
DEFAULT_RECIPES: dict[str, Recipe] = {
    "mi300x": Recipe(
        model_path="lmsys/gpt-oss-120b-bf16",
        weight_format="fp8",
        args=("--quantization", "fp8", "--attention-backend", "triton", "--mem-fraction-static", "0.85"),
        env={"SGLANG_USE_AITER": "0"},
        image="lmsysorg/sglang:v0.5.23-rocm720-mi30x",
    ),
    "mi355x": Recipe(
        model_path="openai/gpt-oss-120b",
        weight_format="mxfp4",
        args=("--attention-backend", "aiter", "--mem-fraction-static", "0.85"),
        env={"SGLANG_USE_AITER": "1"},
        image="lmsysorg/sglang:v0.5.23-rocm720-mi35x",
    ),
}


class _RecipesFile(pydantic.BaseModel):
    """A recipes file: `recipes:` by GPU type; anything else in it (a whole federation config)
    is not the agent's business."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    recipes: dict[StrictStr, Recipe]


def parse_recipes(raw: object, source: str) -> dict[str, Recipe]:
    """The built-in recipes, with those `raw` (a `recipes:` mapping) names replacing theirs."""
    try:
        parsed = _RecipesFile.model_validate({"recipes": raw})
    except pydantic.ValidationError as exc:
        raise RecipeError(describe(exc, source)) from None
    return {**DEFAULT_RECIPES, **parsed.recipes}


def load_recipes(path: Path | None) -> dict[str, Recipe]:
    """The recipes in a YAML file's `recipes:` (the federation's config file will do), over the
    built-in ones; the built-in ones alone without a file."""
    if path is None:
        return dict(DEFAULT_RECIPES)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"cannot read recipes from {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: the top level must be a mapping")
    return parse_recipes(raw.get("recipes", {}), str(path))


def command_line(recipe: Recipe, model: str, host: str, port: int) -> list[str]:
    """launch_server's arguments for one worker (after `python -m sglang.launch_server`)."""
    return [
        *("--model-path", recipe.model_path),
        *("--served-model-name", model),
        *("--tokenizer-path", recipe.tokenizer_path or model),
        *("--tp-size", str(recipe.tp)),
        *("--host", host, "--port", str(port)),
        *("--stream-interval", str(recipe.stream_interval)),
        "--incremental-streaming-output",  # deltas: SGLang's default repeats the whole answer in every event
        "--enable-metrics",  # the agent reads each worker's load from /metrics
        "--enable-cache-report",  # a worker's own OpenAI routes say what its prefix cache held (docs/CACHE.md)
        *recipe.args,
    ]


def worker_env(recipe: Recipe, worker: int, base: Mapping[str, str], first_gpu: int = 0) -> dict[str, str]:
    """Worker `worker`'s environment: `base`, the recipe's, and its own GPUs, counted from the
    host's GPU `first_gpu` (another agent on the host has those before it)."""
    first = first_gpu + worker * recipe.gpus_per_worker
    gpus = ",".join(str(g) for g in range(first, first + recipe.gpus_per_worker))
    return {**base, **recipe.env, "HIP_VISIBLE_DEVICES": gpus}
