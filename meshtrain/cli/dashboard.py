"""``meshtrain dashboard [RUN_DIR...]`` and the ``--dashboard`` of launch and simulate.

The web server lives in :mod:`meshtrain.dashboard` (the optional extra
``meshtrain[dashboard]``); this module only starts it, prints its URL, and registers the
live run as an observer (:mod:`meshtrain.observers`) for as long as the run goes.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.text import Text

from meshtrain import observers
from meshtrain.cli.console import console, errors, fail
from meshtrain.cli.flags import checked_options, takes_options
from meshtrain.config.dashboard import DASHBOARD, LOCALHOST, DashboardSettings

if TYPE_CHECKING:
    from meshtrain.dashboard.state import LiveRun

EXTRA_HINT = "pip install 'meshtrain[dashboard]'"

#: The ``--dashboard`` flag of ``simulate`` and ``launch``.
DASHBOARD_FLAG = typer.Option(
    False, "--dashboard", rich_help_panel="Output",
    help="Serve a live web dashboard of this run on 127.0.0.1 (a free port; the URL, token included, "
         "is printed). Needs the dashboard extra: pip install meshtrain\\[dashboard].")


def require_extra(asked_by: str) -> None:
    """Exit 2 naming the extra when the web server library is missing."""
    if importlib.util.find_spec("aiohttp") is None:
        raise fail(f"{asked_by}: the aiohttp package is not installed; {EXTRA_HINT}")


def _warn_if_exposed(host: str) -> None:
    if host not in (LOCALHOST, "localhost", "::1"):
        errors.print(f"[bold yellow]warning:[/] the dashboard listens on {escape(host)}: anyone who can "
                     "reach this machine there and learns the URL (its token) sees your runs; it is plain "
                     "HTTP. Prefer 127.0.0.1 and an SSH tunnel (ssh -L).", highlight=False, soft_wrap=True)


def _start(state: Any, host: str, port: int) -> Any:
    from meshtrain.dashboard.server import DashboardServer

    try:
        return DashboardServer(state, host, port).start()
    except OSError as exc:
        raise fail(f"dashboard: cannot listen on {host}:{port} ({exc.strerror or exc})") from None


@contextmanager
def live_dashboard(enabled: bool, kind: str, run_id: str, names: list[str],
                   info: Mapping[str, Any] | None = None) -> Iterator[LiveRun | None]:
    """While inside: a dashboard of this run (``kind``: launch or simulate) on 127.0.0.1,
    its URL printed, fed through the observers. Yields None when not ``enabled``.

    A run that raises is marked failed there. Afterwards, whether it finished or failed, on
    a terminal the page stays up until Enter or Ctrl-C (at most :data:`STAY_OPEN_S`), so the
    final state, the error included, can still be looked at.
    """
    if not enabled:
        yield None
        return
    require_extra("--dashboard")
    from meshtrain.dashboard.state import DashboardState

    state = DashboardState()
    live = state.live_run(run_id, names, kind, info)
    server = _start(state, LOCALHOST, 0)
    console.print(f"dashboard: [bold]{server.url}[/]", highlight=False, soft_wrap=True)
    try:
        with observers.watching(live):
            try:
                yield live
            except KeyboardInterrupt:
                live.failed("interrupted (Ctrl-C)")
                raise  # the user asked to stop: the page goes with the run
            except BaseException as exc:
                message = str(exc) or type(exc).__name__
                live.failed(message)
                live.ended()
                _stay_open(f"failed run ({message})")
                raise
            finally:
                live.ended()
        _stay_open("finished run")
    finally:
        server.stop()


#: The longest the page of a finished or failed run stays up, waiting for Enter.
STAY_OPEN_S = 600.0


def _stay_open(what: str) -> None:
    """On a terminal: keep the page up until Enter, Ctrl-C or :data:`STAY_OPEN_S`."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        console.print(Text(f"the dashboard stays open for a look at the {what}: press Enter to close it"),
                      soft_wrap=True)
        _wait_for_enter(STAY_OPEN_S)


def _wait_for_enter(limit: float) -> None:
    done = threading.Event()

    def read_line() -> None:
        sys.stdin.readline()
        done.set()

    threading.Thread(target=read_line, daemon=True).start()
    deadline = time.monotonic() + limit
    try:
        while not done.wait(0.5) and time.monotonic() < deadline:
            pass
    except KeyboardInterrupt:
        pass


@takes_options(DashboardSettings, DASHBOARD)
def dashboard(
    run_dirs: list[Path] = typer.Argument(
        None, metavar="RUN_DIR",
        help="Finished run directories to show (or folders holding them, like runs/); several "
             "can be compared."),
    **options: Any,
) -> None:
    """Serve a web dashboard of finished runs: loss against steps, bytes and wall-clock,
    measured against projected time, every node, events; tick runs to compare them.

    The URL it prints holds a random token: requests without it get 403. For a live run,
    give --dashboard to `meshtrain launch` or `meshtrain simulate` instead.
    """
    # An empty --host ("$HOST" unset) is refused by the setting's rule: "" binds every interface.
    how = checked_options(DashboardSettings, options)
    require_extra("meshtrain dashboard")
    from meshtrain.dashboard.state import DashboardState, RunDirError, find_run_directories

    state = DashboardState()
    damaged = 0
    for path in run_dirs or []:
        try:
            found = find_run_directories(path)
        except RunDirError as exc:  # a path given that holds no run at all: nothing to show
            raise fail(str(exc)) from None
        for run_dir in found:
            try:
                state.add_run_directory(run_dir)
            except RunDirError as exc:  # one damaged run: listed as such, the others shown
                state.add_damaged_directory(run_dir, str(exc))
                errors.print(Text.assemble(("warning: ", "bold yellow"), f"{exc}; shown as damaged"),
                             soft_wrap=True)
                damaged += 1
    _warn_if_exposed(how.host)
    server = _start(state, how.host, how.port)
    shown = f"{len(state.runs)} run{'s' if len(state.runs) != 1 else ''}"
    if damaged:
        shown += f", {damaged} damaged"
    console.print(f"dashboard of {shown}: "
                  f"[bold]{server.url}[/]\nCtrl-C to stop", highlight=False, soft_wrap=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    """Add ``meshtrain dashboard`` to the app."""
    app.command("dashboard")(dashboard)
