"""Operational log lines (storage faults, a close that dropped work) as structlog events
through the standard `logging` module, under `hicache.*` logger names.

A library must not print to stdout or take over the application's structlog setup: each
logger here renders its event as one JSON object and hands it to `logging`, whose
handlers the application configures (with none configured, warnings and errors go to
stderr). `hicache.runtime.testing.capture_logs` reads them back in tests. The delivery
log is separate (`hicache.runtime.DeliveryLog`).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog


def logger(name: str) -> Any:
    """A structlog logger over the stdlib logger `name`, independent of structlog's global setup."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.add_log_level, structlog.processors.JSONRenderer(sort_keys=True)],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
