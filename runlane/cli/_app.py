"""``APP``: import ``module:attribute`` and check that it names a Runlane."""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback

from runlane._codec import exception_text
from runlane.errors import ConfigurationError
from runlane.runtime import Runlane
from runlane.toolkit import clipped, shown

__all__ = ["load_app"]


def load_app(spec: str) -> Runlane:
    """Import ``module:attribute`` and return the Runlane it names; a ConfigurationError
    says what is wrong with ``spec``."""
    module_name, sep, attribute = spec.partition(":")
    dotted = (module_name, attribute)
    if not sep or not all(part.isidentifier() for name in dotted for part in name.split(".")):
        # a path or a relative name ("../app:x", ".app:x") is no module import_module takes
        raise ConfigurationError(
            f"APP must look like module:attribute, dotted Python names (e.g. "
            f"myproject.tasks:runlane, imported from the current directory), got {shown(spec)}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import {shown(module_name)}: {clipped(exception_text(exc))}"
        ) from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed while importing
        raise ConfigurationError(
            f"importing {shown(module_name)} failed: {type(exc).__name__}: "
            f"{clipped(' '.join(exception_text(exc).split()))}{_where(exc)} "
            "(run with --traceback for the whole traceback)"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ConfigurationError(
                f"{shown(module_name)} has no attribute {shown(attribute)}"
            ) from exc
    if not isinstance(target, Runlane):
        raise ConfigurationError(
            f"{shown(spec)} is a {type(target).__name__}, not a Runlane made by create_runlane"
        )
    return target


def _where(exc: BaseException) -> str:
    """`` (at path:line)``: the innermost frame of the application's code (not the standard
    library's, nor the import machinery's) in the traceback, where the import failed."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    package = os.path.dirname(os.path.dirname(__file__))  # runlane/, not only runlane/cli/
    skipped = ("<", sysconfig.get_paths()["stdlib"], package + os.sep)
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(skipped)
    ]
    if not frames:
        return ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno})"
