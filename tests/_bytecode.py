"""Bytecode for this checkout, written once by the pytest process that starts the workers.

With ``PYTHONDONTWRITEBYTECODE`` set (as in this environment and many CI images) no process
caches what it compiles, so each xdist worker rewrote and compiled every test file while
collecting (about 6.5 CPU-seconds each), and each ``runlane`` subprocess compiled the package
it imports (about 0.2-0.3 CPU-seconds each). The controller compiles them first: the
package's ordinary ``__pycache__`` files (``compileall``, skipping those already current),
the same for the tests' helper modules, and pytest's assertion-rewritten test modules and
conftest files (the cache pytest itself would write, checked by source hash, so an edited
file is rewritten again). Nothing here changes what runs: a pyc that cannot be written (a
read-only install) is left to be compiled as before.
"""

from __future__ import annotations

import compileall
import importlib.util
import re
from pathlib import Path

import pytest
from _pytest.assertion import rewrite  # pytest's cache of rewritten modules (private)

__all__ = ["compile_checkout"]

TESTS = Path(__file__).resolve().parent
# what pytest rewrites, and so never imports through the ordinary pyc
REWRITTEN = re.compile(r"(^|[/\\])(test_[^/\\]*|conftest)\.py$")


def compile_checkout(config: pytest.Config) -> None:
    """Compile the ``runlane`` package and, when xdist workers will collect the suite, the
    test modules as pytest rewrites them; in the controller only, before the workers start."""
    if hasattr(config, "workerinput") or config.getoption("collectonly"):
        return
    spec = importlib.util.find_spec("runlane")
    for location in (spec.submodule_search_locations or []) if spec else []:
        compileall.compile_dir(location, quiet=2, workers=1)
    # the tests' helpers (tests/helpers.py, tests/soak/...), imported by workers and by the
    # subprocesses of the soak and the CLI tests
    compileall.compile_dir(TESTS, quiet=2, workers=1, rx=REWRITTEN)
    if config.getoption("tx", None) and config.getoption("dist", "no") != "no":
        _rewrite_tests(config)


def _rewrite_tests(config: pytest.Config) -> None:
    names = ("PYC_TAIL", "_read_pyc", "_rewrite_test", "_write_pyc", "get_cache_dir")
    if not all(hasattr(rewrite, name) for name in names):  # moved in a later pytest
        return
    state = config.stash.get(rewrite.assertstate_key, None)
    if state is None:  # --assert=plain: nothing is rewritten
        return
    for source in sorted([*TESTS.rglob("test_*.py"), *TESTS.rglob("conftest.py")]):
        cache_dir = rewrite.get_cache_dir(source)
        pyc = cache_dir / (source.name[:-3] + rewrite.PYC_TAIL)
        if rewrite._read_pyc(source, pyc) is not None:
            continue
        try:
            cache_dir.mkdir(exist_ok=True)
        except OSError:
            return
        try:
            source_hash, code = rewrite._rewrite_test(source, config)
        except (OSError, SyntaxError, ValueError):
            continue  # left to the worker's collection, which reports it
        rewrite._write_pyc(state, code, source_hash, pyc)
