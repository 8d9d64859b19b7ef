"""``path("runlane/", include("runlane.integrations.django.urls"))``: the console under
``runlane/`` (any prefix), every path below it its own."""

from __future__ import annotations

from django.urls import re_path

from runlane.integrations.django.views import console

app_name = "runlane"
urlpatterns = [re_path(r"^(?P<path>.*)\Z", console, name="console")]
