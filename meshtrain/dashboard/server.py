"""The dashboard's web server: one page and one JSON endpoint, behind a token.

aiohttp runs on its own event loop in a background thread, so a training run (threads,
or the launcher's reader threads) goes on undisturbed. Security:

* it listens on 127.0.0.1 unless told otherwise;
* every request must carry the token (``?token=`` or the ``X-Meshtrain-Token`` header),
  compared in constant time; anything else gets 403 before a route is looked at;
* its Host header must name this machine: an IP address, ``localhost``, or the name the
  server was told to listen on (this machine's name when it listens everywhere). A web page
  whose DNS name is rebound to 127.0.0.1 sends its own name there and is refused (403),
  token or not; the port is not checked, so an SSH tunnel to another port still works;
* the page is self-contained (its script and style inlined, nothing from the network) and
  served with a Content-Security-Policy that allows only them and requests to this server,
  and no Referer is ever sent (the token is in the URL);
* a request that is not HTTP (a header line of 200 KB, no Host, random bytes) is answered 400
  and not logged: anyone who can reach the port could otherwise print tracebacks into the
  terminal of the run the dashboard shows.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
from collections.abc import Collection
from importlib import resources
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from meshtrain.config.dashboard import LOCALHOST
from meshtrain.dashboard.state import DashboardState

TOKEN_HEADER = "X-Meshtrain-Token"


class _NotClientErrors(logging.Filter):
    """Drops the records of requests a client got wrong (aiohttp's parser refused them and
    answered 400); the server's own errors are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, HttpProcessingError)


#: The logger aiohttp's request handlers report to (instead of its shared "aiohttp.server").
SERVER_LOG = logging.getLogger("meshtrain.dashboard.server")
SERVER_LOG.addFilter(_NotClientErrors())


def new_token() -> str:
    """A random token for one dashboard (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def token_matches(given: str | None, token: str) -> bool:
    """Whether ``given`` is ``token``, compared in constant time (None never matches)."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def page(nonce: str) -> str:
    """index.html with app.js and style.css inlined, both allowed by ``nonce``."""
    static = resources.files("meshtrain.dashboard") / "static"
    html = (static / "index.html").read_text(encoding="utf-8")
    style = (static / "style.css").read_text(encoding="utf-8")
    script = (static / "app.js").read_text(encoding="utf-8")
    return (html.replace("<!--STYLE-->", f'<style nonce="{nonce}">\n{style}</style>')
                .replace("<!--SCRIPT-->", f'<script nonce="{nonce}">\n{script}</script>'))


def host_allowed(header: str | None, names: Collection[str] = ()) -> bool:
    """Whether a request's Host header (``name[:port]``) names this machine: an IP address,
    ``localhost`` (``*.localhost`` resolves there too), or one of ``names``."""
    if not header:
        return False
    name = header.strip().lower()
    if name.startswith("["):  # [::1]:8080
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":")[0]
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name == "localhost" or name.endswith(".localhost") or name in {n.lower() for n in names}


def build_app(state: DashboardState, token: str, host_names: Collection[str] = ()) -> web.Application:
    """The aiohttp application: ``/`` (the page) and ``/api/state`` (JSON), token required
    and a Host header naming this machine (:func:`host_allowed`, ``host_names`` allowed)."""

    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), host_names):  # DNS rebinding
            return web.Response(status=403, text="403: forbidden (the Host header does not name this "
                                "machine)\n", headers=_SECURITY_HEADERS)
        given = request.query.get("token") or request.headers.get(TOKEN_HEADER)
        if not token_matches(given, token):
            return web.Response(status=403, text="403: forbidden (the dashboard's URL carries a token)\n",
                                headers=_SECURITY_HEADERS)
        response = await handler(request)
        response.headers.update(_SECURITY_HEADERS)
        return response

    async def index(request: web.Request) -> web.Response:
        nonce = secrets.token_urlsafe(16)
        csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
               "frame-ancestors 'none'")
        return web.Response(text=page(nonce), content_type="text/html",
                            headers={"Content-Security-Policy": csp})

    async def api_state(request: web.Request) -> web.Response:
        snapshot = state.snapshot()
        return web.Response(text=json.dumps(snapshot, allow_nan=False), content_type="application/json")

    app = web.Application(middlewares=[require_token])
    app.router.add_get("/", index)
    app.router.add_get("/api/state", api_state)
    return app


_SECURITY_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                     "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}


class DashboardServer:
    """Serves ``state`` on ``host:port`` (0: a free port) from a background thread.

    Use as a context manager, or :meth:`start` and :meth:`stop`; :attr:`url` is the
    address to open, token included.
    """

    def __init__(self, state: DashboardState, host: str = LOCALHOST, port: int = 0,
                 token: str | None = None) -> None:
        self.state = state
        self.host = host
        self.token = token or new_token()
        self._sock = _listen(host, port)  # bound now: a taken port is an error before anything runs
        self.port = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="meshtrain-dashboard",
                                        daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        if self.host in ("0.0.0.0", "::"):
            shown = socket.gethostname()
        return f"http://{shown}:{self.port}/?token={self.token}"

    def start(self) -> DashboardServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        return self

    async def _serve(self) -> None:
        names = {self.host, socket.gethostname(), socket.getfqdn()} if self.host in ("0.0.0.0", "::") \
            else {self.host}
        self._runner = web.AppRunner(build_app(self.state, self.token, names), access_log=None,
                                     logger=SERVER_LOG)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def stop(self) -> None:
        if self._thread.is_alive():
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (raises OSError naming what failed)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
