"""structlog, configured once per process: JSON lines unless a person is watching."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> None:
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    tail: list[structlog.typing.Processor]
    if sys.stderr.isatty():
        tail = [structlog.dev.ConsoleRenderer()]
    else:  # a traceback (log.exception) becomes a structured field, not a lost `exc_info: true`
        # No local variables: they would copy prompts into the logs.
        tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        tail = [structlog.processors.ExceptionRenderer(tracebacks), structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[*processors, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
