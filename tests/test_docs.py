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


# -- names ---------------------------------------------------------------------------------
# Every runlane name the docs and README mention must exist: a dotted ``runlane.x.y`` resolves
# (a module, an attribute, a Runlane or RunContext method when ``runlane`` is the runtime, or a
# logger/metric/span name runlane's code spells as a string), and a snake_case name in
# backticks is one runlane's code defines, takes or says. The docs once told users to call
# ``cancel_run``, which never existed.

DOTTED = re.compile(r"\brunlane(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SPAN = re.compile(r"`([^`\n]+)`")
BARE = re.compile(r"([a-z_][a-z0-9_]*)(\(.*\))?")
FILE_SUFFIXES = {"md", "py", "toml", "yml", "sql", "html", "txt"}
# names the docs use that are not runlane's code: example role names, AMQP queue names built
# from parts (runlane.s.<environment>.<queue>), the child key prefix, a Postgres function,
# a dunder, the console's form field and action names, Django's call_command
NOT_CODE = {
    "app_producer",
    "app_worker",
    "app_maintenance",
    "app_operator",
    "runlane_owner",
    "runlane.s.a",
    "runlane.s.a.b.c",
    "runlane.child",
    "pg_terminate_backend",
    "__str__",
    "call_command",
}


@attrs.frozen
class SourceNames:
    identifiers: frozenset[str]  # every name runlane's code (and SQL, and messages) spells
    literals: frozenset[str]  # its string constants: logger, metric and span names


def _source_names() -> SourceNames:
    import ast  # noqa: PLC0415 - only this check parses

    identifiers: set[str] = set()
    literals: set[str] = set()
    for path in sorted((ROOT / "runlane").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                identifiers.add(node.id)
            elif isinstance(node, ast.Attribute):
                identifiers.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                identifiers.add(node.name)
            elif isinstance(node, ast.arg | ast.keyword):
                identifiers.add(node.arg or "")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
                identifiers.update(re.findall(r"[A-Za-z_]\w*", node.value))
    for path in sorted((ROOT / "runlane").rglob("*.sql")):
        identifiers.update(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    for path in sorted((ROOT / "tests").rglob("test_*.py")):  # a test a page names
        identifiers.update(re.findall(r"def (test_\w+)", path.read_text()))
    for path in sorted((ROOT / "examples").rglob("*.py")):  # what the examples define
        identifiers.update(re.findall(r"(?:def|class) (\w+)", path.read_text()))
    return SourceNames(frozenset(identifiers), frozenset(literals))


def _resolves(dotted: str) -> bool:
    """``dotted`` names a module or an attribute (an attrs field included) under runlane."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        rest = parts[cut:]
        break
    else:  # pragma: no cover - "runlane" itself imports
        return False
    for part in rest:
        fields = {a.name for a in getattr(target, "__attrs_attrs__", ())}
        if hasattr(target, part):
            target = getattr(target, part)
        elif part in fields:
            target = None
        else:
            return False
    return True


def unknown_names(text: str, names: SourceNames) -> set[str]:
    """The runlane names ``text`` mentions that do not exist."""
    from runlane import RunContext  # noqa: PLC0415

    unknown: set[str] = set()
    for match in DOTTED.finditer(text):
        name = match.group(0)
        last = name.rsplit(".", 1)[1]
        if last in FILE_SUFFIXES or name in NOT_CODE or name in names.literals:
            continue
        if _resolves(name) or any(lit.startswith(f"{name}.") for lit in names.literals):
            continue
        method = name.split(".")[1]  # `runlane.trigger(...)`: the runtime in examples
        if hasattr(Runlane, method) or hasattr(RunContext, method):
            continue
        unknown.add(name)
    for match in SPAN.finditer(text):
        bare = BARE.fullmatch(match.group(1).strip())
        if bare is None or "_" not in bare.group(1):
            continue
        if bare.group(1) not in names.identifiers and bare.group(1) not in NOT_CODE:
            unknown.add(bare.group(1))
    return unknown


@pytest.fixture(scope="module")
def source_names() -> SourceNames:
    return _source_names()


@pytest.mark.parametrize(
    "page",
    [*pages(), ROOT / "README.md", *sorted((ROOT / "examples").rglob("README.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_runlane_name_in_the_docs_exists(page: Path, source_names: SourceNames) -> None:
    unknown = unknown_names(page.read_text(), source_names)
    assert not unknown, f"{page.relative_to(ROOT)} names what runlane does not have: {unknown}"


def test_the_name_check_catches_a_missing_name(source_names: SourceNames) -> None:
    text = (
        "to cancel a run, call `cancel_run`; `runlane.cancel(run_id)` works, "
        "and so do `runlane.testing.run_until_idle`, `runlane.worker` (a logger) and "
        "`Runlane.list_runs`, but not `runlane.testing.start_rabbitmq_node` nor "
        "`runlane.integrations.flask.FlaskApp`"
    )
    assert unknown_names(text, source_names) == {
        "cancel_run",
        "runlane.testing.start_rabbitmq_node",
        "runlane.integrations.flask.FlaskApp",
    }


def test_runtime_messages_name_only_calls_that_exist(source_names: SourceNames) -> None:
    """A message telling the user to call ``runlane.x(...)``, ``Runlane.x(...)`` or
    ``context.x(...)`` names a method that exists."""
    from runlane import RunContext  # noqa: PLC0415

    calls = re.compile(r"\b(runlane|Runlane|context)\.([a-z_]\w*)\(")
    missing = {
        f"{owner}.{method}"
        for literal in source_names.literals
        for owner, method in calls.findall(literal)
        if not hasattr(RunContext if owner == "context" else Runlane, method)
        and not _resolves(f"runlane.{method}")
    }
    # "call cancel_run": a named call in prose, a method of the runtime, the context or the
    # package, or a dotted name that resolves
    for literal in source_names.literals:
        for name in re.findall(r"\bcall `?([A-Za-z_][\w.]*\w)", literal):
            if "_" not in name and "." not in name:
                continue  # a word ("call it", "call start")
            owner, _, method = name.rpartition(".")
            known = (
                hasattr(Runlane, method)
                or hasattr(RunContext, method)
                or _resolves(f"runlane.{name}")
                or (owner in ("Runlane", "runlane") and hasattr(Runlane, method))
            )
            if not known:
                missing.add(name)
    assert not missing, f"runlane's messages tell users to call {missing}"
