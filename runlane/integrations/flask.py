"""``runlane.integrations.flask``: runlane as a Flask extension (``pip install 'runlane[flask]'``).

::

    from runlane.integrations.flask import FlaskRunlane

    ext = FlaskRunlane(runlane)        # the runtime create_runlane made

    def create_app():
        app = Flask(__name__)
        ext.init_app(app)
        return app

``init_app(app)``:

- enters ``app.app_context()`` around every attempt (outermost, before the middleware given
  to ``create_runlane``), so handlers use ``current_app``, its config and extensions as views
  do; ``FlaskRunlane(runlane, app_context=False)`` leaves it out. Workers made before the
  first ``init_app`` are not changed: call it before starting any. Called again (an app
  factory run once per test), the newest app's context is the one entered;
- stores the extension as ``app.extensions["runlane"]``;
- adds the ``flask runlane`` command group: ``worker``, ``drain``, ``maintenance``,
  ``status``, ``runs``, ``queues``, ``workers``, ``schedules`` and ``trigger``, the ``runlane``
  commands of the same names and options acting on this runtime (``flask --app shop.app
  runlane worker --concurrency 8 --with-maintenance``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    import click
    from flask import Flask
except ImportError as exc:  # pragma: no cover - the flask extra is not installed
    raise ImportError(
        "runlane.integrations.flask needs Flask: pip install 'runlane[flask]'"
    ) from exc

from runlane import cli
from runlane.errors import ConfigurationError
from runlane.runtime import Runlane
from runlane.toolkit import shown

__all__ = ["COMMANDS", "FlaskRunlane"]

# the runlane commands `flask runlane` offers: those taking APP, and those whose APP comes
# after an action word (`runs list APP`)
_DIRECT = ("worker", "drain", "maintenance", "status", "workers", "trigger")
_NESTED = ("runs", "queues", "schedules")
COMMANDS = _DIRECT + _NESTED

# the runtime a `flask runlane` command acts on, named to runlane's CLI as an APP
# (runlane.integrations.flask:cli_runtime); one command runs per process
cli_runtime: Runlane | None = None
_APP = f"{__name__}:cli_runtime"


class FlaskRunlane:
    """A Flask extension binding a :class:`~runlane.Runlane` to Flask apps.

    ``FlaskRunlane(runlane, app=None, *, app_context=True)``; ``app`` given calls
    :meth:`init_app` at once. ``runlane`` may instead be given to ``init_app``.
    """

    def __init__(
        self,
        runlane: Runlane | None = None,
        app: Flask | None = None,
        *,
        app_context: bool = True,
    ) -> None:
        if runlane is not None and not isinstance(runlane, Runlane):
            raise ConfigurationError(
                f"FlaskRunlane takes the Runlane create_runlane made, got {shown(runlane)}"
            )
        if not isinstance(app_context, bool):
            raise ConfigurationError(f"app_context must be True or False, got {shown(app_context)}")
        self._runlane = runlane
        self._app_context = app_context
        self._context: _AppContext | None = None
        if app is not None:
            self.init_app(app)

    @property
    def runlane(self) -> Runlane:
        if self._runlane is None:
            raise ConfigurationError(
                "this FlaskRunlane has no runtime yet: give it FlaskRunlane(runlane) or "
                "init_app(app, runlane=runlane)"
            )
        return self._runlane

    def init_app(self, app: Flask, runlane: Runlane | None = None) -> None:
        """Bind ``app``: its app context around every attempt, ``app.extensions["runlane"]``
        and the ``flask runlane`` commands."""
        if not isinstance(app, Flask):
            raise ConfigurationError(f"init_app takes a Flask app, got {shown(app)}")
        if runlane is not None:
            if not isinstance(runlane, Runlane):
                raise ConfigurationError(
                    f"init_app(runlane=...) takes the Runlane create_runlane made, got "
                    f"{shown(runlane)}"
                )
            if self._runlane is not None and self._runlane is not runlane:
                raise ConfigurationError("this FlaskRunlane is already bound to another runtime")
            self._runlane = runlane
        runtime = self.runlane
        if self._app_context:
            if self._context is None:
                self._context = _AppContext(app)
                runtime.wrap_attempts(self._context)
            self._context.app = app  # an app factory called again (tests): the newest app
        app.extensions["runlane"] = self
        app.cli.add_command(_command_group(self))


class _AppContext:
    """The middleware entering ``app``'s context around an attempt."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.__qualname__ = f"app_context of {app.name!r}"

    def __call__(self, context: object) -> Any:
        return self.app.app_context()


def _runlane_args(command: str, args: Sequence[str]) -> list[str]:
    """The runlane CLI's arguments for ``flask runlane COMMAND ARGS``: APP inserted where
    that command takes it."""
    rest = list(args)
    if command in _NESTED:
        if not rest or rest[0].startswith("-"):  # no action word: the command's own help
            return [command, *rest]
        return [command, rest[0], _APP, *rest[1:]]
    return [command, _APP, *rest]


def _command_group(extension: FlaskRunlane) -> click.Group:
    group = click.Group(
        "runlane",
        help="runlane's commands on this app's runtime (`flask runlane COMMAND --help`).",
    )
    for name in COMMANDS:
        group.add_command(_passthrough(extension, name))
    return group


def _passthrough(extension: FlaskRunlane, name: str) -> click.Command:
    @click.command(
        name,
        help=f"`runlane {name}` on this app's runtime (see `flask runlane {name} --help`).",
        context_settings={"ignore_unknown_options": True, "help_option_names": []},
        add_help_option=False,
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        global cli_runtime  # noqa: PLW0603 - the APP runlane's CLI imports, one per process
        cli_runtime = extension.runlane
        try:
            code = cli.main(_runlane_args(name, args))
        finally:
            cli_runtime = None
        raise SystemExit(code)

    return command
