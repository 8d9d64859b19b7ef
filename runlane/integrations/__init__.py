"""Integrations with the frameworks runlane's users write their applications in.

- :mod:`runlane.integrations.flask`: ``FlaskRunlane``, a Flask extension (an app context
  around every attempt, ``flask runlane ...`` commands); ``pip install 'runlane[flask]'``.
- :mod:`runlane.integrations.sentry`: ``sentry_scope``, a middleware giving each attempt its
  own Sentry scope tagged with the run; ``pip install 'runlane[sentry]'``.

Django and FastAPI need no runlane module: see ``docs/integrations/django.md`` and
``docs/integrations/fastapi.md``.
"""
