"""The Django app ``runlane.integrations.django`` (label ``runlane``): its settings are
checked when Django starts, so a missing or malformed one is one clear line at once rather
than a failed request later."""

from __future__ import annotations

from django.apps import AppConfig

from runlane.integrations.django._settings import check_settings

__all__ = ["RunlaneConfig"]


class RunlaneConfig(AppConfig):
    name = "runlane.integrations.django"
    label = "runlane"
    verbose_name = "runlane"

    def ready(self) -> None:
        check_settings()
