"""How long `fedctl up` takes to be ready and how much memory it holds: the newcomer's first
command, measured as docs/BENCHMARKS.md records it ("The embedded default's footprint").

    python3 scripts/measure_up.py [fedctl up's arguments, e.g. --launch or --config F]

Starts `fedctl up` with those arguments, times its "federation ready" line and the answer to a
first chat at the endpoint that line names, sums the resident memory of its whole process tree
(psutil) once the chat is answered, stops it with Ctrl-C (SIGINT) and prints one JSON line:
`ready_s`, `first_chat_s`, `processes`, `rss_mb`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil

READY_TIMEOUT_S = 300.0


def main(argv: list[str]) -> int:
    started = time.monotonic()
    up = subprocess.Popen([sys.executable, "-m", "federation.cli", "up", *argv], stderr=subprocess.PIPE, text=True)
    try:
        endpoint, ready_s = _ready(up, started)
        # Its log lines go on to the pipe: read on, or a full pipe would stall the processes writing them.
        threading.Thread(target=lambda: [None for _ in up.stderr or ()], daemon=True).start()
        body = {"model": "openai/gpt-oss-120b", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20}
        request = urllib.request.Request(
            endpoint + "/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            json.load(response)
        first_chat_s = time.monotonic() - started
        tree = [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]
        rss = 0
        for process in tree:
            try:
                rss += process.memory_info().rss
            except psutil.Error:  # gone between the listing and the read
                pass
        print(
            json.dumps(
                {
                    "args": argv,
                    "ready_s": round(ready_s, 2),
                    "first_chat_s": round(first_chat_s, 2),
                    "processes": len(tree),
                    "rss_mb": round(rss / 2**20),
                }
            )
        )
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


def _ready(up: subprocess.Popen[str], started: float) -> tuple[str, float]:
    """The endpoint `fedctl up` says it serves, and when it said so."""
    assert up.stderr is not None
    for line in up.stderr:
        found = re.search(r"federation ready: (\S+)", line)
        if found:
            return found[1], time.monotonic() - started
        if time.monotonic() - started > READY_TIMEOUT_S:
            break
    raise SystemExit(f"fedctl up did not get ready (exit code {up.poll()})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
