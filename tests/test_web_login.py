"""``runlane web``'s login over real HTTP (review findings 4 and 5 of issue 39): a session ends
at logout and after 12 hours on the server, not only in the browser; a CSRF token read
before the login (from a cookie someone planted) is refused after it; failed logins are
logged and a client that keeps failing waits (429); behind a proxy that says HTTPS
(``--proxy-headers``) the cookies are Secure and ``__Host-``, and without that option the
header is not believed."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from http.cookies import SimpleCookie
from typing import Any

import pytest

from runlane import Runlane, queue
from runlane.web import EnvironmentLogin, create_app
from tests.conftest import RunlaneFactory
from tests.helpers import closed_port, poll
from tests.test_web import served

TOKEN = "s3cret-token-for-the-login"
HOUR = 3600.0


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Message
    text: str

    def getheader(self, name: str) -> str | None:
        return self.headers.get(name)


class Client:
    """A browser's cookie jar over http.client: each request real HTTP, no redirect
    followed; ``headers`` go with every request (a proxy's, say)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.headers = headers or {}
        self.cookies: dict[str, str] = {}
        self.set_cookie_lines: list[str] = []

    def send(self, method: str, path: str, form: dict[str, str] | None = None) -> Answer:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        headers = dict(self.headers)
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = urllib.parse.urlencode(form) if form is not None else None
        if body is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            answer = Answer(response.status, response.headers, response.read().decode())
        finally:
            conn.close()
        lines = answer.headers.get_all("Set-Cookie") or []
        self.set_cookie_lines += lines
        for line in lines:
            for name, morsel in SimpleCookie(line).items():
                if morsel["max-age"] == "0" or not morsel.value:
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return answer

    def get(self, path: str) -> Answer:
        return self.send("GET", path)

    def post(self, path: str, **form: str) -> Answer:
        return self.send("POST", path, form)


def csrf(page: str) -> str:
    return page.split('name="csrf_token" value="')[1].split('"', maxsplit=1)[0]


def acting(client: Client) -> bool:
    return 'id="identity"' in client.get("/queues").text


def log_in(client: Client, token: str = TOKEN) -> Answer:
    return client.post("/login", csrf_token=csrf(client.get("/login").text), token=token)


class Clock:
    """The login's clock, moved by the test (seconds since the epoch)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(queues=[queue("default", default=True)])


@pytest.fixture
def console(rl: Runlane) -> Iterator[tuple[str, Clock]]:
    """The console with a token login on a moved clock, served over real HTTP."""
    clock = Clock()
    login = EnvironmentLogin(token=TOKEN, user=None, password=None, clock=clock)
    with served(create_app(rl, authorize=login)) as url:
        yield url, clock


def test_a_session_ends_at_logout_and_after_twelve_hours(
    console: tuple[str, Clock], rl: Runlane
) -> None:
    url, clock = console
    browser = Client(url)
    assert log_in(browser).status == 303
    assert acting(browser)
    copied = dict(browser.cookies)  # what a thief of the cookie holds
    page = browser.get("/queues").text
    assert browser.post("/logout", csrf_token=csrf(page)).status == 303
    assert "runlane_session" not in browser.cookies
    assert not acting(browser)

    thief = Client(url)
    thief.cookies = copied
    assert not acting(thief)  # the copy ended with the logout, on the server
    assert thief.post("/queues/pause", csrf_token=csrf(page), name="default").status == 403
    assert not rl.list_queues()[0].paused

    # a session lasts 12 hours from its login, then the server refuses it
    assert log_in(browser).status == 303
    clock.now += 12 * HOUR - 1
    assert acting(browser)
    clock.now += 2
    assert not acting(browser)
    assert log_in(browser).status == 303  # a new login is a new session
    assert acting(browser)


def test_a_csrf_token_read_before_the_login_is_worthless_after_it(
    console: tuple[str, Clock], rl: Runlane
) -> None:
    url, _ = console
    attacker = Client(url)
    attacker.cookies["runlane_csrf"] = "planted-seed-of-the-attacker-0123"
    planted = csrf(attacker.get("/login").text)  # the token the attacker can read

    victim = Client(url)
    victim.cookies["runlane_csrf"] = "planted-seed-of-the-attacker-0123"  # planted
    assert log_in(victim).status == 303
    assert victim.cookies["runlane_csrf"] == "planted-seed-of-the-attacker-0123"
    assert victim.post("/queues/pause", csrf_token=planted, name="default").status == 403
    assert not rl.list_queues()[0].paused
    # the victim's own page carries the token of its login
    own = csrf(victim.get("/queues").text)
    assert own != planted
    assert victim.post("/queues/pause", csrf_token=own, name="default").status == 303
    assert rl.list_queues()[0].paused


def test_failed_logins_are_logged_and_a_client_that_keeps_failing_waits(
    console: tuple[str, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    url, clock = console
    guesser = Client(url)
    caplog.set_level("WARNING", logger="runlane.web")
    answers = [log_in(guesser, f"guess-number-{n}").status for n in range(3)]
    assert answers == [403, 403, 403]
    lines = [r.getMessage() for r in caplog.records if r.name == "runlane.web"]
    assert lines == [
        "a failed login at /login from 127.0.0.1 (1 in a row)",
        "a failed login at /login from 127.0.0.1 (2 in a row)",
        "a failed login at /login from 127.0.0.1 (3 in a row; its next try waits 1 s)",
    ]
    # while it waits, not even the right token is looked at
    refused = log_in(guesser)
    assert (refused.status, refused.getheader("Retry-After")) == (429, "1")
    assert "try again in 1 s" in refused.text
    assert not acting(guesser)
    clock.now += 1
    assert log_in(guesser, "guess-number-3").status == 403  # waits twice as long now
    assert log_in(guesser).getheader("Retry-After") == "2"
    clock.now += 2
    assert log_in(guesser).status == 303
    assert acting(guesser)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert TOKEN not in logged
    assert "guess" not in logged
    # the right token cleared the count: the next typo is free again
    caplog.clear()
    log_in(Client(url), "a-typo-again")
    assert [r.getMessage() for r in caplog.records] == [
        "a failed login at /login from 127.0.0.1 (1 in a row)"
    ]


def _web(database_url: str, schema: str, tmp_path: Any, *extra: str) -> tuple[Any, str]:
    """``runlane web`` with RUNLANE_WEB_TOKEN and ``extra`` options: its process and URL."""
    port = closed_port()
    argv = [sys.executable, "-m", "runlane.cli", "web", "--database-url", database_url]
    argv += ["--schema", schema, "--bind", f"127.0.0.1:{port}", "--threads", "2", *extra]
    env = {**os.environ, "RUNLANE_WEB_TOKEN": TOKEN}
    env.pop("RUNLANE_WEB_PROXY_HEADERS", None)
    proc = subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return Client(url).get("/login").status == 200
        except OSError:
            return proc.poll() is not None

    assert poll(up, timeout=30)
    assert proc.poll() is None, "runlane web exited"
    return proc, url


def _stop(proc: Any) -> str:
    proc.terminate()
    _, err = proc.communicate(timeout=15)
    return str(err)


def test_runlane_web_behind_a_tls_proxy_sets_secure_host_cookies(
    rl: Runlane, database_url: str, schema: str, tmp_path: Any
) -> None:
    https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    proc, url = _web(database_url, schema, tmp_path, "--proxy-headers")
    try:
        browser = Client(url, https)
        assert log_in(browser, "not-the-token").status == 403
        assert log_in(browser).status == 303
        assert set(browser.cookies) == {"__Host-runlane_csrf", "__Host-runlane_session"}
        for line in browser.set_cookie_lines:
            assert "Secure" in line, line
            assert "Path=/;" in line, line
            assert "HttpOnly" in line, line
        assert acting(browser)
        # plain HTTP past the proxy: the __Host- cookies are not read, the session is not held
        plain = Client(url)
        plain.cookies = dict(browser.cookies)
        assert not acting(plain)
    finally:
        err = _stop(proc)
    # the failed login: one line with the client's address (the proxy's X-Forwarded-For)
    assert "a failed login at /login from 203.0.113.9 (1 in a row)" in err
    assert "not-the-token" not in err

    proc, url = _web(database_url, schema, tmp_path)  # without --proxy-headers: not believed
    try:
        browser = Client(url, https)
        assert log_in(browser).status == 303
        assert set(browser.cookies) == {"runlane_csrf", "runlane_session"}
        assert not any("Secure" in line for line in browser.set_cookie_lines)
    finally:
        _stop(proc)
