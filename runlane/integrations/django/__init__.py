"""``runlane.integrations.django``: runlane as a Django app (``pip install 'runlane[django]'``).

::

    # settings.py
    INSTALLED_APPS = [..., "django.contrib.auth", "django.contrib.sessions",
                      "runlane.integrations.django"]
    RUNLANE_APP = "orders.runlane_app:runlane"   # module:attribute, as the CLI's APP

    # urls.py
    urlpatterns = [..., path("runlane/", include("runlane.integrations.django.urls"))]

- the console (:mod:`runlane.web`) is served under that prefix by the Django project itself,
  behind Django's auth: an anonymous visitor is sent to ``LOGIN_URL``, a signed-in user who
  is not active staff gets 403. Staff may act (retry, cancel, pause, ...);
  ``RUNLANE_CONSOLE_ACTIONS`` narrows that to ``"superuser"``, to a permission
  (``"orders.operate_runlane"``, checked with ``user.has_perm``), or to nobody (``None``: a
  read-only console). The console keeps its own CSRF token, so its view is exempt from
  Django's; its CSRF key is derived from ``SECRET_KEY``, the same in every process;
- ``manage.py runlane_worker``, ``runlane_maintenance`` and ``runlane_status`` are
  ``runlane worker``, ``maintenance`` and ``status`` on ``RUNLANE_APP``, inside Django
  (settings, app registry, ``LOGGING``): the same options, output, exit codes and graceful
  SIGTERM.

See docs/integrations/django.md.
"""

from __future__ import annotations

try:
    import django  # noqa: F401 - only to say what is missing
except ImportError as exc:  # pragma: no cover - the django extra is not installed
    raise ImportError(
        "runlane.integrations.django needs Django: pip install 'runlane[django]'"
    ) from exc

__all__: list[str] = []
