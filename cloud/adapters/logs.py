"""The server's logs: one JSON object per line on stderr (`harken serve`, Ray replicas)."""

from __future__ import annotations

import json
import logging
import sys


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger("harken")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
