"""The view serving the console: only to active staff, others to login or 403."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from runlane.integrations.django._mount import call_console

__all__ = ["console"]


# exempt from Django's CSRF check only because the console checks its own on every POST (a
# token bound to a cookie of its own; see runlane.web's security): Django's would refuse the
# console's forms, which carry the console's token, not Django's
@csrf_exempt
def console(request: HttpRequest, path: str = "") -> HttpResponseBase:
    """The console at the prefix this view is included under, for signed-in active staff;
    an anonymous visitor is sent to ``LOGIN_URL``, anyone else is refused (403)."""
    user = getattr(request, "user", None)
    if user is None:
        raise ImproperlyConfigured(
            "the runlane console needs django.contrib.auth's AuthenticationMiddleware in "
            "MIDDLEWARE (it serves staff users only)"
        )
    if not user.is_authenticated:
        # imported here: django.contrib.auth needs settings and the app registry, and this
        # module imports without them (the docs check names it)
        from django.contrib.auth.views import redirect_to_login  # noqa: PLC0415

        return redirect_to_login(request.get_full_path())
    if not (user.is_active and user.is_staff):
        raise PermissionDenied("the runlane console is for staff users")
    return call_console(request, path)
