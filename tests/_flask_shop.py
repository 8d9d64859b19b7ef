"""examples/flask's ``shop`` package imported against fresh schemas, for the tests of the
example and of the Flask extension it uses."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flask"


@contextmanager
def flask_shop(database_url: str, prefix: str) -> Iterator[Any]:
    """``shop.app`` imported with its own runlane and shop schemas (named from ``prefix``),
    its tables created; afterwards the package is forgotten and both schemas dropped."""
    suffix = uuid.uuid4().hex[:12]
    schemas = {"RUNLANE_SCHEMA": f"{prefix}_rl_{suffix}", "SHOP_SCHEMA": f"{prefix}_shop_{suffix}"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATABASE_URL", database_url)
        for name, value in schemas.items():
            patch.setenv(name, value)
        patch.syspath_prepend(str(EXAMPLE))
        try:
            app_module = importlib.import_module("shop.app")
            app_module.init_db()
            yield app_module
        finally:
            for name in [m for m in sys.modules if m == "shop" or m.startswith("shop.")]:
                del sys.modules[name]
            with psycopg.connect(database_url, autocommit=True) as conn:
                for schema in schemas.values():
                    conn.execute(
                        sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema))
                    )
