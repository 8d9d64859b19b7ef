"""psycopg.pool's records about runlane's own pools go to ``runlane.postgres.pool`` at DEBUG
(installed once, when this module is imported)."""

from __future__ import annotations

import logging

__all__: list[str] = []


class _OwnPoolRecords(logging.Filter):
    """On the ``psycopg.pool`` logger: the records about runlane's own pools (named
    ``runlane-...``: reconnect attempts, each connection handed out) leave that logger and go
    to ``runlane.postgres.pool`` at DEBUG, so a database outage is reported once, by runlane,
    and not as one WARNING per reconnect try; ``--log-level DEBUG`` (or that logger at
    DEBUG) shows them; so does setting ``psycopg.pool`` itself to DEBUG, as psycopg logs
    them. Records about other pools of the process pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not any(isinstance(a, str) and a.startswith("runlane-") for a in args):
            return True
        if logging.NOTSET < _psycopg_pool_log.level <= logging.DEBUG:
            return True  # psycopg.pool itself was asked for everything: as it logs them
        if _pool_log.isEnabledFor(logging.DEBUG):
            _pool_log.debug("%s (psycopg.pool %s)", record.getMessage(), record.levelname)
        return False


_pool_log = logging.getLogger("runlane.postgres.pool")
_psycopg_pool_log = logging.getLogger("psycopg.pool")
if not any(isinstance(f, _OwnPoolRecords) for f in _psycopg_pool_log.filters):
    _psycopg_pool_log.addFilter(_OwnPoolRecords())
