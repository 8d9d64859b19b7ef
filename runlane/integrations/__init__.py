"""Integrations with the frameworks runlane's users write their applications in.

- :mod:`runlane.integrations.flask`: ``FlaskRunlane``, a Flask extension (an app context
  around every attempt, ``flask runlane ...`` commands); ``pip install 'runlane[flask]'``.
- :mod:`runlane.integrations.sentry`: ``sentry_scope``, a middleware giving each attempt its
  own Sentry scope tagged with the run; ``pip install 'runlane[sentry]'``.

- :mod:`runlane.integrations.django`: a Django app (the console behind Django's auth, for
  staff users; ``manage.py runlane_worker``, ``runlane_maintenance``, ``runlane_status``);
  ``pip install 'runlane[django]'``.

FastAPI needs no runlane module: see ``docs/integrations/fastapi.md``.
"""
