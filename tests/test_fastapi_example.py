"""examples/fastapi through FastAPI's TestClient on the test database: sync endpoints trigger
in the request's transaction (a request answered 409 leaves no run), the app's worker runs
the run, and bad input is refused before anything is written."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._optional import require
from tests.helpers import wait_until

require("fastapi")
require("httpx2")  # the client FastAPI's TestClient uses
from fastapi.testclient import TestClient  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fastapi"


@pytest.fixture
def thumbnails(database_url: str) -> Iterator[Any]:
    suffix = uuid.uuid4().hex[:12]
    schemas = {"RUNLANE_SCHEMA": f"fastapi_rl_{suffix}", "APP_SCHEMA": f"fastapi_app_{suffix}"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATABASE_URL", database_url)
        for name, value in schemas.items():
            patch.setenv(name, value)
        patch.syspath_prepend(str(EXAMPLE))
        module = importlib.import_module("thumbnails")
        try:
            module.init_db()
            yield module
        finally:
            module.runlane.close()
            del sys.modules["thumbnails"]
            with psycopg.connect(database_url, autocommit=True) as conn:
                for schema in schemas.values():
                    conn.execute(
                        sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema))
                    )


def run_count(module: Any) -> int:
    return len(module.runlane.list_runs(task="thumbnails.make", limit=100).runs)


def test_a_sync_endpoint_triggers_in_its_transaction_and_the_run_completes(
    thumbnails: Any,
) -> None:
    with TestClient(thumbnails.app) as client:
        accepted = client.post("/thumbnails", json={"image": "cat.png", "width": 200})
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["run_id"]

        def done() -> bool:
            return bool(client.get(f"/thumbnails/{run_id}").json()["status"] == "completed")

        wait_until(done, timeout=30, what="the thumbnail run")
        assert client.get(f"/thumbnails/{run_id}").json()["output"] == {
            "image": "cat.png",
            "thumbnail": "cat.png@200w",
        }

        # the same image again: 409, and the run triggered before the refusal is gone
        again = client.post("/thumbnails", json={"image": "cat.png", "width": 300})
        assert again.status_code == 409, again.text
        assert run_count(thumbnails) == 1

        refused = client.post("/thumbnails", json={"image": "dog.png", "width": 0})
        assert refused.status_code == 422
        assert run_count(thumbnails) == 1
        assert client.get(f"/thumbnails/{uuid.uuid4()}").status_code == 404
