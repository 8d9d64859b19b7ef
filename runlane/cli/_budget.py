"""``runlane maintenance --limit NAME=N``: a pass's budget, a :class:`MaintenanceLimits`.

``NAME`` is a field of ``MaintenanceLimits`` spelled in full (``due_delivery_limit``), as the
Python API and its error messages spell it. Each value goes through the class's own
validator when the argument is parsed, so a bad one is a usage error (exit 2) before
anything connects.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import attrs

from runlane.errors import ConfigurationError
from runlane.maintenance import MaintenanceLimits

__all__ = ["add_limit_option", "limits_of", "non_default_limits", "with_limits"]

NAMES = tuple(field.name for field in attrs.fields(MaintenanceLimits))
DEFAULTS = attrs.asdict(MaintenanceLimits())


def add_limit_option(
    parser: argparse.ArgumentParser, applies: str = "for --once and the services alike"
) -> None:
    """``--limit NAME=N``, repeatable; collected by name in ``args.limits``. ``applies``
    says, in the help, which maintenance it budgets."""
    defaults = ", ".join(f"{name} {value}" for name, value in DEFAULTS.items())
    parser.add_argument(
        "--limit",
        dest="limits",
        metavar="NAME=N",
        type=_limit_setting,
        action=_CollectLimits,
        default=None,
        help=f"records one phase may change in one pass, {applies} "
        "(repeatable, each NAME once; 0 skips that work). NAME is a MaintenanceLimits field; "
        f"the defaults: {defaults}",
    )


def limits_of(args: argparse.Namespace) -> MaintenanceLimits:
    """The budget ``--limit`` gave (each value already validated), the defaults elsewhere."""
    return MaintenanceLimits(**(args.limits or {}))


def non_default_limits(limits: MaintenanceLimits) -> dict[str, int]:
    """The fields of ``limits`` that differ from the defaults, by name."""
    return {name: value for name, value in attrs.asdict(limits).items() if DEFAULTS[name] != value}


def with_limits(changed: dict[str, int]) -> str:
    """`` with limits a=1, b=2`` for a start-up line (empty when nothing differs)."""
    budget = ", ".join(f"{name}={value}" for name, value in changed.items())
    return f" with limits {budget}" if budget else ""


def _limit_setting(text: str) -> tuple[str, int]:
    """``NAME=N`` as (name, value), refused with the reason unless ``MaintenanceLimits``
    takes it."""
    name, sep, number = text.partition("=")
    name = name.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=N, got {text!r}")
    if name not in NAMES:
        raise argparse.ArgumentTypeError(_unknown(name))
    try:
        value = int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}: expected an integer, got {number.strip()!r}"
        ) from None
    try:
        MaintenanceLimits(**{name: value})  # the class's own bounds
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, value


def _unknown(name: str) -> str:
    hint = f" (did you mean {name}_limit?)" if f"{name}_limit" in NAMES else ""
    return f"unknown limit {name!r}{hint}; expected one of {', '.join(NAMES)}"


class _CollectLimits(argparse.Action):
    """Gathers the ``--limit`` settings into a dict; a name given twice is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, tuple)  # what _limit_setting returns
        name, value = values
        given: dict[str, int] = dict(getattr(namespace, self.dest) or {})
        if name in given:
            raise argparse.ArgumentError(self, f"{name} given twice ({given[name]} and {value})")
        given[name] = value
        setattr(namespace, self.dest, given)
