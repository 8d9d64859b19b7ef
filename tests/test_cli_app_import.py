"""An ``APP`` whose module raises while importing is one line naming the module, the
exception and where it was raised; ``--traceback`` (before or after the command) adds the
whole traceback."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.cli import EXIT_CONFIGURATION, main


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A fresh module name in a directory that is the current one (as APP is imported)."""
    monkeypatch.chdir(tmp_path)
    name = f"app_{uuid.uuid4().hex[:8]}"
    yield name, tmp_path / f"{name}.py"
    sys.modules.pop(name, None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("import os\nURL = os.environ['NO_SUCH_VARIABLE_X']\n", "KeyError: 'NO_SUCH_VARIABLE_X'"),
        ("raise SystemExit('settings missing')\n", "SystemExit: settings missing"),
        ("def f(:\n    pass\n", "SyntaxError: invalid syntax"),
        ("import json\njson.loads('{')\n", "JSONDecodeError: Expecting property name"),
        # raised inside runlane (tasks.py, not the cli package): still the application's line
        ("from runlane import queue\nq = queue('')\n", "ConfigurationError: queue name ''"),
    ],
)
def test_an_app_failing_to_import_is_one_line(
    module: tuple[str, Path], source: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name, path = module
    path.write_text(source)
    assert main(["status", f"{name}:runlane"]) == EXIT_CONFIGURATION
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"runlane: error: importing '{name}' failed: "), lines[0]
    assert said in lines[0], lines[0]
    assert f"(at {path}:" in lines[0], lines[0]  # the application's line, not json's
    assert lines[0].endswith("(run with --traceback for the whole traceback)")


@pytest.mark.parametrize("where", ["before", "after"])
def test_traceback_prints_the_whole_traceback_then_the_line(
    module: tuple[str, Path], where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name, path = module
    path.write_text("def load():\n    raise RuntimeError('no config')\n\nload()\n")
    command = ["worker", f"{name}:runlane"]
    argv = ["--traceback", *command] if where == "before" else [*command, "--traceback"]
    assert main(argv) == EXIT_CONFIGURATION
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert f'File "{path}", line 2, in load' in err
    assert "RuntimeError: no config" in err
    assert err.splitlines()[-1].startswith(f"runlane: error: importing '{name}' failed")


def test_a_missing_module_and_attribute_stay_one_line(
    module: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    name, path = module
    path.write_text("x = 1\n")
    assert main(["drain", f"{name}:runlane"]) == EXIT_CONFIGURATION
    assert capsys.readouterr().err == f"runlane: error: '{name}' has no attribute 'runlane'\n"
    assert main(["drain", "no_such_module_q:runlane"]) == EXIT_CONFIGURATION
    err = capsys.readouterr().err
    assert err.startswith("runlane: error: cannot import 'no_such_module_q': No module named")
    assert len(err.splitlines()) == 1
