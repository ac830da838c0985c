"""SGLang's own benchmark client, `sglang.bench_serving`, against the federation's gateway, offline
on a CPU-only machine: the output tokens it counts for each backend beside the gateway's own
count (`federation_gateway_output_tokens_total` on its /metrics).

    scripts/install-sglang                   # once: SGLang's code without its GPU stack
    fedctl up &                              # or any running gateway
    python3 scripts/sglang_bench_serving.py --base-url http://127.0.0.1:8080

It makes here what bench_serving would otherwise download: the GPT-OSS tokenizer directory
(o200k_base from the ranks inside the bpe-openai wheel, plus the Harmony special tokens at
gpt-oss's ids) and a ShareGPT-shaped dataset (`--dataset-name random` cuts its prompts from
one); the hub is kept offline. SGLang imports torchvision, which bench_serving never calls and
which cannot install beside the CPU torch: scripts/sglang_stubs stands in for it.

bench_serving's command line (its `cli_main`, what `python -m sglang.bench_serving` runs) is run
once per backend in this one process, so its import (many seconds of CPU: torch, transformers
and much of SGLang) is paid once; with `--warmup-requests 0`, since the gateway would count the
warm-up request that bench_serving leaves out. bench_serving's report goes to stderr; stdout has
one JSON line per backend: requests completed, its output tokens, its count of the received text
re-tokenized, and the rise of the gateway's counter meanwhile. Exits 1 when a backend's output
tokens differ from the gateway's. (Its OpenAI backends take the count from the stream's `usage`
and, when there is none, as the chat stream has unless asked, from the lengths they requested:
there the re-tokenized count is the one measured.)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.resources
import importlib.util
import json
import os
import random
import sys
import time
import urllib.request
import warnings
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

STUBS = Path(__file__).resolve().parent / "sglang_stubs"
MODEL = "openai/gpt-oss-120b"
GATEWAY_TOKENS = "federation_gateway_output_tokens_total"  # by site: summed
READY_WAIT_S = 60.0  # the gateway can serve (GET /health: 200, a site ready) within this long

# o200k_base's pre-tokenizer pattern (tiktoken's), and the special tokens gpt-oss's tokenizer
# (o200k_harmony) adds after o200k_base's 199,998 ranks, at its ids.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
HARMONY_SPECIALS = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|reserved_200000|>": 200000,
    "<|reserved_200001|>": 200001,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|reserved_200004|>": 200004,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|reserved_200009|>": 200009,
    "<|reserved_200010|>": 200010,
    "<|reserved_200011|>": 200011,
    "<|call|>": 200012,
}
WORDS = (
    "the federation routes each request to the site with the least expected delay while its "
    "schedulers measure capacity and its agents stream tokens from workers across regions"
).split()


def make_tokenizer(out: Path) -> None:
    """A Hugging Face tokenizer directory equivalent to gpt-oss's, from bpe-openai's o200k ranks."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out.mkdir(parents=True, exist_ok=True)
    ranks = out / "o200k_base.tiktoken"
    packed = importlib.resources.files("bpe_openai") / "data" / "o200k_base.tiktoken.gz"
    ranks.write_bytes(gzip.decompress(packed.read_bytes()))
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_PATTERN).converted()
    for name, token_id in sorted(HARMONY_SPECIALS.items(), key=lambda kv: kv[1]):  # added in id order
        tokenizer.add_special_tokens([AddedToken(name, normalized=False, special=True)])
        if tokenizer.token_to_id(name) != token_id:
            raise RuntimeError(f"{name} got id {tokenizer.token_to_id(name)}, gpt-oss has {token_id}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|return|>", bos_token="<|startoftext|>", pad_token="<|endoftext|>"
    )
    fast.model_max_length = 131072
    fast.save_pretrained(str(out))
    ranks.unlink()


def make_dataset(path: Path, conversations: int = 200, seed: int = 1) -> None:
    """ShareGPT's shape: conversations of a human turn and an answer (only their text is used)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    rows = [
        {
            "id": f"synthetic-{i}",
            "conversations": [
                {"from": "human", "value": text(rng.randint(20, 200))},
                {"from": "gpt", "value": text(rng.randint(20, 200))},
            ],
        }
        for i in range(conversations)
    ]
    path.write_text(json.dumps(rows))


def gateway_tokens(base_url: str) -> float:
    """The gateway's output tokens so far, all sites together."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == GATEWAY_TOKENS
    )


def wait_ready(base_url: str) -> None:
    """Until /health answers 200 (the gateway: 503 until a site is ready; SGLang: until loaded).
    bench_serving's own check asks /v1/models, which the gateway answers before any site is ready."""
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5):
                return
        except OSError:  # refused, or an HTTP error status
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def bench_argv(args: argparse.Namespace, backend: str, tokenizer: Path, dataset: Path, result: Path) -> list[str]:
    """bench_serving's command line for one backend (what would follow `python -m sglang.bench_serving`)."""
    if args.dataset == "generated-shared-prefix":  # its own prompts: at bench_serving's --gsp-* defaults
        data = ["--dataset-name", "generated-shared-prefix", "--num-prompts", str(args.num_prompts)]
    else:
        data = ["--dataset-name", "random", "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts)]
        data += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    return [
        *("--backend", backend, "--base-url", args.base_url, "--model", args.model),
        *("--tokenizer", str(tokenizer), *data, "--seed", str(args.seed)),
        *("--warmup-requests", "0", "--output-file", str(result)),
        *args.bench_args,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080", help="the gateway")
    parser.add_argument("--model", default=MODEL, help="the served model name")
    parser.add_argument("--backends", nargs="+", default=["sglang", "sglang-oai-chat"])
    parser.add_argument(
        "--dataset",
        choices=["random", "generated-shared-prefix"],
        default="random",
        help="bench_serving's --dataset-name: random (its prompts cut from a ShareGPT-shaped file made here), or "
        "generated-shared-prefix (groups of questions after a shared system prompt; its --gsp-* flags after --)",
    )
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=64, help="--random-input-len")
    parser.add_argument("--output-len", type=int, default=32, help="--random-output-len")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("sglang-bench"), help="tokenizer, dataset, results")
    parser.add_argument("bench_args", nargs="*", help="after --: more bench_serving flags")
    args = parser.parse_args()

    # Nothing from the hub: the tokenizer and the dataset are made below.
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if importlib.util.find_spec("torchvision") is None:
        sys.path.append(str(STUBS))
    warnings.filterwarnings("ignore", category=FutureWarning, module="sglang")  # bench_serving's new name
    from sglang.bench_serving import cli_main

    tokenizer, dataset = args.workdir / "o200k-harmony", args.workdir / "sharegpt.json"
    if not (tokenizer / "tokenizer.json").exists():
        make_tokenizer(tokenizer)
    if not dataset.exists():
        make_dataset(dataset, seed=args.seed)
    wait_ready(args.base_url)

    differ = False
    for backend in args.backends:
        result = args.workdir / f"result-{backend}.jsonl"
        result.unlink(missing_ok=True)
        before = gateway_tokens(args.base_url)
        sys.argv = ["sglang.bench_serving", *bench_argv(args, backend, tokenizer, dataset, result)]
        with contextlib.redirect_stdout(sys.stderr):
            cli_main()
        gateway = round(gateway_tokens(args.base_url) - before)
        report = json.loads(result.read_text().splitlines()[-1])
        line = {
            "backend": backend,
            "completed": report["completed"],
            "output_tokens": report["total_output_tokens"],
            "output_tokens_retokenized": report["total_output_tokens_retokenized"],
            "gateway_output_tokens": gateway,
        }
        print(json.dumps(line), flush=True)
        differ |= line["output_tokens"] != gateway
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
