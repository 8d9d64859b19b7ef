"""The settings the Django app reads, checked once when Django starts."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from runlane.toolkit import shown

__all__ = [
    "STAFF",
    "SUPERUSER",
    "actions_rule",
    "app_spec",
    "check_settings",
    "console_config",
    "console_key",
]

STAFF = "staff"
SUPERUSER = "superuser"


def app_spec() -> str:
    """``RUNLANE_APP``: the ``module:attribute`` naming the project's Runlane."""
    spec = getattr(settings, "RUNLANE_APP", None)
    if not isinstance(spec, str) or ":" not in spec:
        raise ImproperlyConfigured(
            f"RUNLANE_APP must name the project's Runlane as 'module:attribute' (e.g. "
            f"'orders.runlane_app:runlane'), got {shown(spec)}"
        )
    return spec


def actions_rule() -> str | None:
    """``RUNLANE_CONSOLE_ACTIONS``: who may act in the console (``"staff"``, the default;
    ``"superuser"``; a permission ``"app_label.codename"``; ``None``: nobody)."""
    rule: Any = getattr(settings, "RUNLANE_CONSOLE_ACTIONS", STAFF)
    if rule is None or rule in (STAFF, SUPERUSER):
        return rule  # type: ignore[no-any-return]
    if isinstance(rule, str) and rule.count(".") == 1 and all(rule.split(".")):
        return rule
    raise ImproperlyConfigured(
        f"RUNLANE_CONSOLE_ACTIONS must be 'staff', 'superuser', a permission "
        f"'app_label.codename', or None for a read-only console; got {shown(rule)}"
    )


def console_config() -> dict[str, Any]:
    """``RUNLANE_CONSOLE_CONFIG``: Flask config values for the console's app (e.g.
    ``{"RUNLANE_REFRESH_SECONDS": 30}``)."""
    config: Any = getattr(settings, "RUNLANE_CONSOLE_CONFIG", {})
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise ImproperlyConfigured(
            f"RUNLANE_CONSOLE_CONFIG must be a dict of Flask config values, got {shown(config)}"
        )
    return dict(config)


def console_key() -> bytes:
    """The console's CSRF key: derived from ``SECRET_KEY`` (the same in every process of the
    project, and not ``SECRET_KEY`` itself)."""
    secret = settings.SECRET_KEY
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hmac.new(raw, b"runlane.integrations.django console csrf", hashlib.sha256).digest()


def check_settings() -> None:
    app_spec()
    actions_rule()
    console_config()
