"""Settings of the example shop: Django on PostgreSQL through psycopg 3, runlane in the same
database.

DATABASE_URL names the database (postgresql://user:password@host:port/name); the shop's
tables live in schema SHOP_SCHEMA (default "shop") and runlane's in RUNLANE_SCHEMA (default
"runlane"), both read in orders/runlane_app.py too.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

DATABASE_URL = os.environ["DATABASE_URL"]
SHOP_SCHEMA = os.environ.get("SHOP_SCHEMA", "shop")
RUNLANE_SCHEMA = os.environ.get("RUNLANE_SCHEMA", "runlane")

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "only-for-the-example")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    # runlane's console at /runlane/ (staff only) and manage.py runlane_worker,
    # runlane_maintenance and runlane_status, all on RUNLANE_APP
    "runlane.integrations.django",
    "orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "shopsite.urls"
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True}]
LOGIN_URL = "/accounts/login/"
RUNLANE_APP = "orders.runlane_app:runlane"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_url = conninfo_to_dict(DATABASE_URL)
DATABASES = {
    "default": {
        # Django uses psycopg 3 when it is installed (Django 4.2 and later)
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.get("dbname", ""),
        "USER": _url.get("user", ""),
        "PASSWORD": _url.get("password", ""),
        "HOST": _url.get("host", ""),
        "PORT": _url.get("port", ""),
        "OPTIONS": {"options": f"-c search_path={SHOP_SCHEMA}"},
        # requests run in autocommit; views open transaction.atomic() where they need one
        "ATOMIC_REQUESTS": False,
        "CONN_MAX_AGE": 60,
    }
}
# runlane's records, once each, in the web process and in `manage.py runlane_worker`: they do
# not propagate to the root logger, where `runlane worker` (which the command runs) puts its
# own handler, so the worker would write every line twice
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"line": {"format": "{asctime} {levelname} {name}: {message}", "style": "{"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "line"}},
    "loggers": {"runlane": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}
