"""Running the application: bind, say where, serve until Ctrl-C, shut down cleanly (uvicorn)."""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from attnlab.tools.serve.app import LOOPBACK_NAMES, create_app
from attnlab.tools.serve.engine import Engine

__all__ = ["bind", "is_loopback", "serve"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> set[str] | None:
    """The names a request's Host header may carry on a server bound to ``host``: a loopback server's
    names and its own address (127.0.0.2 is a loopback address they do not cover); None (any) elsewhere."""
    return LOOPBACK_NAMES | {host.strip("[]").lower()} if is_loopback(host) else None


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, chosen by the system)."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the engine when it shuts down and says where it listens."""

    def __init__(self, config: uvicorn.Config, engine: Engine, on_ready: Callable[[], None]):
        super().__init__(config)
        self.engine, self.on_ready = engine, on_ready
        self.signal_received: int | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.on_ready()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.closing = True  # streaming generations end at their next token
        self.signal_received = sig
        super().handle_exit(sig, frame)


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve ``engine`` on ``host:port`` until interrupted; prints the address on stdout once it
    accepts connections, and a one-line warning on stderr when ``host`` is not a loopback address.

    On Ctrl-C (SIGINT) the server stops accepting, ends streaming generations, waits up to 3 s for
    requests in flight, and raises KeyboardInterrupt, which ``attnlab`` turns into exit status 130
    without a traceback."""
    loopback = is_loopback(host)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{shown}:{actual}/"

    def ready() -> None:
        if not loopback:
            print(
                f"attnlab serve: warning: listening on {host}, reachable from other machines; "
                "the API has no authentication (the default --host 127.0.0.1 is this machine only)",
                file=sys.stderr,
                flush=True,
            )
        print(f"attnlab serve: {engine.name} at {url} (Ctrl-C to stop)", flush=True)
        engine.warm_up()  # the head roles, in the background

    app = create_app(engine, allowed_hosts=allowed_hosts(host))
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level in ("info", "debug", "trace"),
        timeout_graceful_shutdown=3,
        lifespan="off",
        server_header=False,
    )
    server = _Server(config, engine, ready)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.signal_received == signal.SIGINT:
        # uvicorn re-raised it, but a process started with SIGINT ignored (a background job of a
        # non-interactive shell) gets no KeyboardInterrupt from that: exit 130 all the same.
        raise KeyboardInterrupt
