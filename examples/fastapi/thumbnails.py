"""examples/fastapi: sync ``def`` endpoints (FastAPI runs them in its thread pool) trigger runs
in the request's own transaction; a worker runs them in the same process.

Run `uvicorn thumbnails:app` in this folder, with DATABASE_URL set (RUNLANE_SCHEMA and
APP_SCHEMA name the schemas, default "runlane" and "thumbnails"). With several processes
(`--workers 4`), set RUN_WORKER=0 and run `runlane worker thumbnails:runlane` once instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import attrs
import psycopg
from fastapi import Depends, FastAPI, HTTPException
from psycopg import sql
from psycopg_pool import ConnectionPool
from pydantic import BaseModel, Field

from runlane import RunContext, RunNotFound, create_runlane, queue, task
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane

DATABASE_URL = os.environ["DATABASE_URL"]
RUNLANE_SCHEMA = os.environ.get("RUNLANE_SCHEMA", "runlane")
APP_SCHEMA = os.environ.get("APP_SCHEMA", "thumbnails")
RUN_WORKER = os.environ.get("RUN_WORKER", "1") == "1"


@attrs.frozen
class MakeThumbnail:
    image: str
    width: int


@task(id="thumbnails.make", schema=MakeThumbnail, queue="thumbnails")
def make_thumbnail(payload: MakeThumbnail, context: RunContext) -> dict[str, Any]:
    # resize the image here; the result is stored with the run
    return {"image": payload.image, "thumbnail": f"{payload.image}@{payload.width}w"}


runlane = create_runlane(
    lane=postgres_polling_lane(connection_string=DATABASE_URL, schema=RUNLANE_SCHEMA),
    queues=[queue("thumbnails", default=True)],
    tasks=[make_thumbnail],
)
pool = ConnectionPool(
    DATABASE_URL, kwargs={"options": f"-c search_path={APP_SCHEMA}"}, max_size=8, open=False
)


def init_db() -> None:
    """Deployment step: runlane's migrations and the app's table."""
    apply_postgres_storage_migrations(connection_string=DATABASE_URL, schema=RUNLANE_SCHEMA)
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute(sql.SQL("create schema if not exists {}").format(sql.Identifier(APP_SCHEMA)))
        conn.execute(
            sql.SQL(
                "create table if not exists {}.requests (image text primary key, run_id uuid)"
            ).format(sql.Identifier(APP_SCHEMA))
        )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool.open()
    worker = runlane.create_delivery_worker(concurrency=2) if RUN_WORKER else None
    try:
        yield
    finally:
        if worker is not None:
            worker.close(timeout=30)  # hands unfinished runs back
        runlane.close()
        pool.close()


app = FastAPI(lifespan=lifespan)


def transaction() -> Iterator[psycopg.Connection[Any]]:
    """One connection and one transaction per request: committed when the endpoint returns,
    rolled back when it raises (an HTTPException included)."""
    with pool.connection() as conn:
        yield conn


Transaction = Annotated[psycopg.Connection[Any], Depends(transaction)]


class ThumbnailRequest(BaseModel):
    image: str = Field(min_length=1, max_length=200)
    width: int = Field(gt=0, le=4000)


@app.post("/thumbnails", status_code=202)
def request_thumbnail(body: ThumbnailRequest, conn: Transaction) -> dict[str, str]:
    # a plain `def` endpoint: runlane's blocking calls belong in FastAPI's thread pool
    handle = runlane.trigger(make_thumbnail, body.model_dump(), connection=conn)
    inserted = conn.execute(
        "insert into requests (image, run_id) values (%s, %s) on conflict do nothing",
        (body.image, handle.id),
    ).rowcount
    if not inserted:  # the transaction rolls back: the run just triggered never existed
        raise HTTPException(status_code=409, detail=f"{body.image} was already requested")
    return {"run_id": str(handle.id)}


@app.get("/thumbnails/{run_id}")
def thumbnail_status(run_id: uuid.UUID) -> dict[str, Any]:
    try:
        run = runlane.get_run(run_id)
    except RunNotFound:
        raise HTTPException(status_code=404, detail="no such run") from None
    return {"status": run.status.value, "output": run.output}
