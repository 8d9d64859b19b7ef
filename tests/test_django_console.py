"""runlane.integrations.django on examples/django, served by waitress in a process of its own
(Django's settings are process-wide: nothing of Django is set up in the test's process).

Chromium signs in as a staff user through Django's login and works in the console mounted at
/runlane/ (pages, its stylesheet, an action whose CSRF token passes Django's CSRF middleware);
an anonymous visitor is sent to the login, a signed-in user who is not staff is refused. The
management commands run as subprocesses on the same database: runlane_status answers as
`runlane status` does, runlane_worker runs an order's run and stops on SIGTERM with exit 0,
runlane_maintenance --once, runlane_audit prints `runlane audit`'s trail, and a bad option
is exit 2 as in the CLI.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import Runlane, RunStatus, create_runlane, queue
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from tests._optional import require

require("django")
require("selenium")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

from tests import test_web  # noqa: E402
from tests.test_web import click, text  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django"
PASSWORD = "a long enough password"

browser = test_web.browser  # the console tests' headless Chromium (a module-scoped fixture)

# the example's settings, with two test-only changes: pages that do not reload themselves
# under the test's feet, and a quick password hasher
TEST_SETTINGS = """\
from shopsite.settings import *  # noqa: F403

RUNLANE_CONSOLE_CONFIG = {"RUNLANE_REFRESH_SECONDS": 600}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
"""

SET_UP = """\
import django
from django.core.management import call_command

django.setup()
call_command("migrate", verbosity=0)
from django.contrib.auth.models import User

User.objects.create_user("ops", password=PASSWORD, is_staff=True)
User.objects.create_user("clerk", password=PASSWORD)
""".replace("PASSWORD", repr(PASSWORD))


@pytest.fixture(scope="module")
def site(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The example on fresh schemas, migrated, with a staff user (ops) and another (clerk),
    served by waitress; a runtime of the test's own on the same schema."""
    suffix = uuid.uuid4().hex[:12]
    settings_dir = tmp_path_factory.mktemp("django_console")
    (settings_dir / "console_settings.py").write_text(TEST_SETTINGS)
    (settings_dir / "bad_settings.py").write_text(
        "from console_settings import *  # noqa: F403\n\nRUNLANE_CONSOLE_ACTIONS = 'everyone'\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "SHOP_SCHEMA": f"djc_shop_{suffix}",
        "RUNLANE_SCHEMA": f"djc_rl_{suffix}",
        "DJANGO_SETTINGS_MODULE": "console_settings",
        "PYTHONPATH": os.pathsep.join(
            [str(settings_dir), str(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create schema {}").format(sql.Identifier(env["SHOP_SCHEMA"])))
    apply_postgres_storage_migrations(connection_string=database_url, schema=env["RUNLANE_SCHEMA"])
    rl = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=env["RUNLANE_SCHEMA"]),
        queues=[queue("orders", default=True)],
    )
    server = None
    try:
        subprocess.run([sys.executable, "-c", SET_UP], cwd=EXAMPLE, env=env, check=True, timeout=60)
        server = subprocess.Popen(
            [sys.executable, "-m", "waitress", "--listen=127.0.0.1:0", "--threads=4",
             "shopsite.wsgi:application"],
            cwd=EXAMPLE, env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        yield {"env": env, "rl": rl, "base": _listening(server)}
    finally:
        if server is not None:
            server.terminate()
            server.communicate(timeout=10)
        rl.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            for schema in (env["SHOP_SCHEMA"], env["RUNLANE_SCHEMA"]):
                conn.execute(
                    sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema))
                )


def _listening(server: subprocess.Popen[str]) -> str:
    """The base URL waitress says it serves on (its first lines, on stderr)."""
    assert server.stderr is not None
    seen = []
    for line in server.stderr:
        seen.append(line)
        if found := re.search(r"Serving on (http://127\.0\.0\.1:\d+)", line):
            return found.group(1)
    pytest.fail(f"waitress did not start: {''.join(seen)}")


def manage(
    site: dict[str, Any], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE, env=site["env"], capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def sign_in(browser: WebDriver, base: str, user: str, then: str) -> None:
    """Visit ``then`` signed out: Django's login page is shown; sign in as ``user``."""
    browser.delete_all_cookies()
    browser.get(base + then)
    assert browser.current_url == f"{base}/accounts/login/?next={urllib.parse.quote(then)}"
    browser.find_element(By.NAME, "username").send_keys(user)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    click(browser, "#sign-in")


def test_staff_work_in_the_console_behind_django_auth(
    browser: WebDriver, site: dict[str, Any]
) -> None:
    base, rl = site["base"], site["rl"]
    sign_in(browser, base, "ops", "/runlane/queues")
    assert browser.current_url == base + "/runlane/queues"
    # the console's own stylesheet came through the mount, and its links stay under it
    header = "return getComputedStyle(document.querySelector('header')).backgroundColor"
    assert browser.execute_script(header) == "rgb(29, 35, 48)"
    links = browser.find_elements(By.CSS_SELECTOR, "header nav a")
    assert links
    assert all((a.get_attribute("href") or "").startswith(base + "/runlane/") for a in links)

    # an action: the console's CSRF token passes, Django's CSRF middleware does not refuse it
    before = {record.id for record in rl.list_audit(limit=1000).items}
    row = "tr[data-queue='orders']"
    click(browser, f"{row} button.pause-queue")
    assert text(browser, "#notice") == "The queue is paused."
    assert browser.current_url.startswith(base + "/runlane/queues")
    assert next(q for q in rl.list_queues() if q.name == "orders").paused
    click(browser, f"{row} button.resume-queue")
    assert not next(q for q in rl.list_queues() if q.name == "orders").paused
    # the audit trail names the Django user who acted
    acted = [
        (record.action, record.target, record.via, record.actor)
        for record in rl.list_audit(limit=1000).items
        if record.id not in before
    ]
    assert acted == [
        ("resume_queue", "orders", "console", "ops"),
        ("pause_queue", "orders", "console", "ops"),
    ]

    # a user who is not staff signs in and is refused
    sign_in(browser, base, "clerk", "/runlane/")
    assert browser.current_url == base + "/runlane/"
    assert "403 Forbidden" in text(browser)
    assert not browser.find_elements(By.CSS_SELECTOR, "header nav a")


def _session(base: str, user: str) -> urllib.request.OpenerDirector:
    """A cookie-keeping client signed in as ``user`` through Django's login form."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(base + "/accounts/login/", timeout=10).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, page
    form = {
        "username": user,
        "password": PASSWORD,
        "csrfmiddlewaretoken": token.group(1),
        "next": "/runlane/",
    }
    with opener.open(base + "/accounts/login/", urllib.parse.urlencode(form).encode()) as page:
        assert page.url == base + "/runlane/"
    return opener


def _post(opener: urllib.request.OpenerDirector, url: str, form: dict[str, str]) -> int:
    try:
        with opener.open(url, urllib.parse.urlencode(form).encode(), timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_the_console_checks_its_own_csrf_token_behind_the_exemption(
    site: dict[str, Any],
) -> None:
    base, rl = site["base"], site["rl"]
    anonymous = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    with anonymous.open(base + "/runlane/", timeout=10) as page:  # redirected to the login
        assert page.url == f"{base}/accounts/login/?next=/runlane/"
    staff = _session(base, "ops")
    pause = base + "/runlane/queues/pause"
    # Django's CSRF check is off for the console's view; the console's own is not
    assert _post(staff, pause, {"name": "orders"}) == 403
    assert _post(staff, pause, {"name": "orders", "csrf_token": "0" * 64}) == 403
    assert not next(q for q in rl.list_queues() if q.name == "orders").paused
    page = staff.open(base + "/runlane/queues", timeout=10).read().decode()
    token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page)
    assert token, page
    # with the page's token: done, and redirected to the queues page
    assert _post(staff, pause, {"name": "orders", "csrf_token": token.group(1)}) == 200
    assert next(q for q in rl.list_queues() if q.name == "orders").paused
    rl.resume_queue("orders")


def test_management_commands_are_the_clis(site: dict[str, Any]) -> None:
    # manage.py's own --settings is manage.py's, not passed on to runlane
    status = manage(site, "runlane_status", "--settings=console_settings", "--json")
    plain = subprocess.run(
        [sys.executable, "-m", "runlane.cli", "status", "orders.runlane_app:runlane", "--json"],
        cwd=EXAMPLE, env=site["env"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert status.returncode == plain.returncode, status.stderr
    report = json.loads(status.stdout)
    assert report.keys() == json.loads(plain.stdout).keys()
    assert "orders" in status.stdout

    bad = manage(site, "runlane_worker", "--concurrency", "many")
    assert bad.returncode == 2, bad.stderr
    assert "--concurrency" in bad.stderr

    # a setting the app cannot read: one line when Django starts, before anything runs
    misread = subprocess.run(
        [sys.executable, "manage.py", "runlane_status"],
        cwd=EXAMPLE, env={**site["env"], "DJANGO_SETTINGS_MODULE": "bad_settings"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert misread.returncode == 1
    assert misread.stderr.splitlines()[-1] == (
        "django.core.exceptions.ImproperlyConfigured: RUNLANE_CONSOLE_ACTIONS must be "
        "'staff', 'superuser', a permission 'app_label.codename', or None for a read-only "
        "console; got 'everyone'"
    )

    once = manage(site, "runlane_maintenance", "--once")
    assert once.returncode == 0, once.stderr

    placed = urllib.request.urlopen(
        urllib.request.Request(
            site["base"] + "/orders",
            data=json.dumps({"item": "widget", "quantity": 1}).encode(),
            headers={"content-type": "application/json"},
        ),
        timeout=10,
    )
    run_id = uuid.UUID(json.loads(placed.read())["run_id"])
    rl: Runlane = site["rl"]
    with subprocess.Popen(
        [sys.executable, "manage.py", "runlane_worker", "--concurrency", "1"],
        cwd=EXAMPLE, env=site["env"], stderr=subprocess.PIPE, text=True,
    ) as worker:  # fmt: skip
        try:
            run = rl.wait_for_run(run_id, timeout=60)
            assert run.status is RunStatus.COMPLETED, run.error
            worker.send_signal(signal.SIGTERM)
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err


def test_runlane_audit_is_the_clis(site: dict[str, Any]) -> None:
    """``manage.py runlane_audit`` prints ``runlane audit``'s trail of the same runtime
    (the test's own pause and resume of a queue, with the reason given), and refuses a bad
    --limit with exit 2 as the CLI does."""
    rl: Runlane = site["rl"]
    rl.pause_queue("orders", reason="audit through manage.py")
    rl.resume_queue("orders", reason="audit through manage.py")
    audit = manage(site, "runlane_audit", "--json", "--limit", "50")
    plain = subprocess.run(
        [sys.executable, "-m", "runlane.cli", "audit", "orders.runlane_app:runlane", "--json",
         "--limit", "50"],
        cwd=EXAMPLE, env=site["env"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (audit.returncode, plain.returncode) == (0, 0), audit.stderr + plain.stderr
    assert json.loads(audit.stdout) == json.loads(plain.stdout)
    ours = [
        (record["action"], record["target"], record["via"])
        for record in json.loads(audit.stdout)["records"]
        if record["reason"] == "audit through manage.py"
    ]
    assert ours == [("resume_queue", "orders", "api"), ("pause_queue", "orders", "api")]
    text = manage(site, "runlane_audit")
    assert text.returncode == 0, text.stderr
    assert "audit through manage.py" in text.stdout
    bad = manage(site, "runlane_audit", "--limit", "0")
    assert bad.returncode == 2, bad.stderr
    assert "--limit" in bad.stderr


@attrs.frozen
class User:
    """What the console's authorize reads of a Django user (the attributes Django's
    AbstractUser and PermissionsMixin give)."""

    is_active: bool = True
    is_staff: bool = True
    is_superuser: bool = False
    perms: frozenset[str] = frozenset()
    username: str = "ada"

    def has_perm(self, perm: str) -> bool:
        return self.is_active and (self.is_superuser or perm in self.perms)

    def get_username(self) -> str:
        return self.username


def test_who_may_act_follows_runlane_console_actions() -> None:
    from flask import Request  # noqa: PLC0415
    from werkzeug.test import EnvironBuilder  # noqa: PLC0415

    from runlane.integrations.django._mount import USER_KEY, authorize_for  # noqa: PLC0415

    def may(rule: str, user: User | None) -> bool:
        environ = {**EnvironBuilder().get_environ(), USER_KEY: user}
        answer = authorize_for(rule)(Request(environ), "retry")
        # allowed: named by the username, the audit trail's actor
        assert answer in (False, "ada"), answer
        return answer == "ada"

    operator = User(perms=frozenset({"orders.operate_runlane"}))
    admin = User(is_superuser=True)
    assert may("staff", User())
    assert not may("staff", User(is_staff=False))
    assert not may("staff", User(is_active=False))
    assert not may("staff", None)
    assert may("superuser", admin)
    assert not may("superuser", operator)
    assert may("orders.operate_runlane", operator)
    assert may("orders.operate_runlane", admin)
    assert not may("orders.operate_runlane", User())
    assert not may("orders.operate_runlane", User(is_staff=False, perms=operator.perms))


# run in a process of its own: it configures Django's settings, which are process-wide
STREAMING = """\
import django
from django.conf import settings

settings.configure(SECRET_KEY="s", ALLOWED_HOSTS=["*"], RUNLANE_APP="shop:runlane")
django.setup()
from django.test import RequestFactory
from flask import Flask, Response, request

from runlane.integrations.django import _mount
from runlane.integrations.django.views import console

app = Flask("stand_in")  # in place of the console: a page that streams, and a form's echo
made = []


@app.get("/events")
def events():
    def chunks():
        for n in range(3):
            made.append(n)
            yield f"data: {n}\\n\\n"

    return Response(chunks(), mimetype="text/event-stream")


@app.post("/echo")
def echo():
    answer = Response(f"{request.get_data(as_text=True)}|{request.script_root}|{request.path}")
    answer.set_cookie("one", "1", path="/ops/rl", httponly=True, samesite="Strict")
    answer.set_cookie("two", "2")
    return answer


_mount._app = app


class Staff:
    is_authenticated = is_active = is_staff = True


asked = RequestFactory().get("/ops/rl/events")
asked.user = Staff()
response = console(asked, path="events")
assert response.streaming and response["Content-Type"].startswith("text/event-stream")
chunks = iter(response.streaming_content)
assert made == []  # nothing made before Django asks for it
assert next(chunks) == b"data: 0\\n\\n" and made == [0]  # one chunk at a time
assert list(chunks) == [b"data: 1\\n\\n", b"data: 2\\n\\n"]
response.close()

form = "name=caf%C3%A9&csrf_token=t"
asked = RequestFactory().post("/ops/rl/echo", form, "application/x-www-form-urlencoded")
asked.user = Staff()
response = console(asked, path="echo")
assert b"".join(response.streaming_content).decode() == f"{form}|/ops/rl|/echo"
assert response.cookies["one"]["path"] == "/ops/rl" and response.cookies["one"]["httponly"]
assert response.cookies["one"]["samesite"] == "Strict" and response.cookies["two"].value == "2"
print("streamed")
"""


def test_a_streamed_response_passes_through_as_it_streams(tmp_path: Path) -> None:
    """What the mount gives Django: each chunk when Django asks for it (server-sent events),
    the form's body and the prefix as the console's SCRIPT_NAME, every cookie."""
    done = subprocess.run(
        [sys.executable, "-c", STREAMING],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "streamed"
