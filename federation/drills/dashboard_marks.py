"""A drill's fault and heal, marked on a running `fedctl dashboard` (`--dashboard URL`), so
whoever watches the federation live sees when the drill struck.

Each mark is POSTed to the dashboard's /api/mark from a thread of its own: the drill's clock
(detection, recovery) never waits on the dashboard, and a dashboard that cannot be reached is
reported and changes nothing else.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request

MARK_TIMEOUT_S = 3.0  # a dashboard on the operator's machine answers in milliseconds


class DashboardMarks:
    def __init__(self, dashboard_url: str | None) -> None:
        """Marks for the dashboard at `dashboard_url` (None: the drill has none to mark)."""
        self.url = dashboard_url.rstrip("/") + "/api/mark" if dashboard_url else None
        self._threads: list[threading.Thread] = []

    def mark(self, label: str) -> None:
        """Mark `label` at this moment (posted in the background)."""
        if self.url is None:
            return
        body = json.dumps({"label": label, "at_unix_s": time.time()}).encode()
        thread = threading.Thread(
            target=self._post, args=(self.url, label, body), name="drill dashboard mark", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def wait(self) -> None:
        """Let the marks in flight arrive (each gives up after MARK_TIMEOUT_S)."""
        for thread in self._threads:
            thread.join(MARK_TIMEOUT_S)

    @staticmethod
    def _post(url: str, label: str, body: bytes) -> None:
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=MARK_TIMEOUT_S) as resp:
                resp.read()
        except OSError as exc:  # URLError and HTTPError are OSErrors
            print(f"fedctl drill: mark {label!r} not posted to {url}: {exc}", file=sys.stderr, flush=True)
