"""A mark someone puts on the timeline (`fedctl drill --dashboard URL`: its fault, its heal),
read from the body of POST /api/mark: `{"label": "...", "at_unix_s": ...}` and nothing else.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

MAX_MARK_BYTES = 1024  # a label and a number: anything larger is not a mark
MAX_LABEL_CHARS = 80  # it is drawn on the timeline
MARK_SKEW_S = 3600.0  # the timeline holds minutes: a mark an hour off is a wrong clock


class BadMark(ValueError):
    """The body is not a mark; the message says why (the 400's body)."""


@dataclass(frozen=True, slots=True)
class Mark:
    label: str
    at_unix_s: float


def parse(body: bytes, now_unix_s: float | None = None) -> Mark:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadMark(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or set(value) != {"label", "at_unix_s"}:
        raise BadMark('a mark is an object with exactly "label" and "at_unix_s"')
    label, at = value["label"], value["at_unix_s"]
    if not isinstance(label, str) or not 0 < len(label.strip()) <= MAX_LABEL_CHARS or not label.isprintable():
        raise BadMark(f'"label" must be printable text of 1 to {MAX_LABEL_CHARS} characters')
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise BadMark('"at_unix_s" must be a number of seconds since the epoch')
    now = time.time() if now_unix_s is None else now_unix_s
    if abs(at - now) > MARK_SKEW_S:
        raise BadMark(f'"at_unix_s" is more than {MARK_SKEW_S:.0f} s from the dashboard\'s clock')
    return Mark(label.strip(), float(at))
