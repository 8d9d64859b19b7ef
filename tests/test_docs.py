"""The documentation site: ``mkdocs build --strict`` passes (warnings are errors: broken links,
pages missing from the nav, docstrings mkdocstrings cannot render), and every ```python block
in docs/ runs against the test database.

A block runs unless the line before its fence is ``<!-- docs-test: skip -->`` (processes that
run until a signal, code needing Flask's request context). The blocks of one page run in
order in one namespace, like a session at the interpreter, with ``DATABASE_URL`` naming a
fresh database whose ``runlane`` schema is migrated; runtimes left open are closed after the
page. A failure names the page and the line of the block."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from runlane import Runlane
from runlane.postgres import apply_postgres_storage_migrations

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARK = "<!-- docs-test: skip -->"
FENCE = re.compile(r"^```(\S*)\s*$")


@attrs.frozen
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    code: str
    runnable: bool


def blocks_of(page: Path) -> list[Block]:
    """The ```python blocks of a page (fences at the start of a line)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{start + 1}: a code fence is never closed")
        if match.group(1) == "python":
            previous = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
            found.append(
                Block(
                    page=page,
                    line=start + 2,
                    code="\n".join(lines[start + 1 : end]) + "\n",
                    runnable=previous.strip() != SKIP_MARK,
                )
            )
        i = end + 1
    return found


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def runnable_pages() -> list[Path]:
    return [page for page in pages() if any(b.runnable for b in blocks_of(page))]


def test_the_docs_have_runnable_examples() -> None:
    runnable = [b for page in pages() for b in blocks_of(page) if b.runnable]
    assert len(runnable) >= 15, "the parser lost the examples, or the docs did"
    names = {page.name for page in runnable_pages()}
    assert {"getting-started.md", "tasks.md", "triggering.md", "durable.md"} <= names


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    if (
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("mkdocstrings") is None
    ):
        message = (
            "mkdocs and mkdocstrings are not installed: pip install -e '.[docs]' (or '.[dev]')"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must build the docs", pytrace=False)
        pytest.skip(message)
    site = tmp_path / "site"
    config = str(ROOT / "mkdocs.yml")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    reference = (site / "reference" / "runlane" / "index.html").read_text()
    for anchor in ("runlane.Runlane.trigger", "runlane.RunContext.wait_for_token"):
        assert f'id="{anchor}"' in reference, f"the API reference lacks {anchor}"
    testing = (site / "reference" / "testing" / "index.html").read_text()
    assert 'id="runlane.testing.run_until_idle"' in testing
    for page in pages():
        relative = page.relative_to(DOCS).with_suffix("")
        built = site / relative / "index.html" if relative.name != "index" else site / relative
        assert built.with_suffix(".html").exists() or built.exists(), f"{page} was not built"


@pytest.fixture
def docs_database(database_url: str) -> Iterator[str]:
    """A fresh database with a migrated ``runlane`` schema; dropped afterwards."""
    name = f"docs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = make_conninfo(database_url, dbname=name)
    try:
        apply_postgres_storage_migrations(connection_string=url, schema="runlane")
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name))
            )


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path, docs_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", docs_database)
    monkeypatch.chdir(ROOT)
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    try:
        for block in blocks_of(page):
            if not block.runnable:
                continue
            # pad with blank lines so a traceback names the line in the .md file
            code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
            try:
                exec(code, namespace)
            except Exception:
                pytest.fail(
                    f"{page.relative_to(ROOT)}:{block.line}: the example starting on this line "
                    f"failed:\n{traceback.format_exc()}",
                    pytrace=False,
                )
    finally:
        for value in namespace.values():
            if isinstance(value, Runlane):
                value.close()
