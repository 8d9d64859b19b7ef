"""``runlane.logging``: a JSON log formatter for runlane's records (and any others).

Every record runlane logs about a run carries ``run_id``, ``task_id``, ``attempt`` and
``queue`` (and, at an attempt's end, ``outcome`` and ``duration_ms``) as ``extra`` fields;
:class:`JsonFormatter` writes them as keys of one JSON object per line, beside the time, the
level, the logger's name, the message and the traceback. ``runlane worker --log-format json``
uses it; an application sets it on its own handler::

    import logging
    from runlane.logging import JsonFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["JsonFormatter"]

# attributes every LogRecord has: what is left in vars(record) came from extra=
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
    ``logger``, ``message``, the record's structured fields (``extra=``), and ``exception``
    (the formatted traceback) and ``stack`` when the record has them. A value JSON cannot
    hold is written as its ``str()``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)
