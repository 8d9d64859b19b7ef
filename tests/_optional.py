"""Optional packages the integrations' tests need (the dev extra installs them all): a test
module without one is skipped with a one-line reason, except under CI=true, where CI must
run it and the missing package fails the run."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, package: str | None = None) -> ModuleType:
    """``module`` imported, or the calling test module skipped (failed under CI=true)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        reason = (
            f"{package or module} is not installed; it is in the dev extra: pip install -e '.[dev]'"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI must run these tests)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
