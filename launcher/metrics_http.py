"""Serves `/metrics`, optionally behind a bearer token (kitchen.v1.Exposure.metrics_token_file).

prometheus_client's own server has no authentication, and /metrics names every team's jobs;
Prometheus sends the token with `authorization: {credentials_file: ...}` in its scrape config.
The token is compared in constant time; a request without it gets 401 and no data.
"""

import hmac
import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the launcher's shutdown


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # one line per scrape would drown the launcher's log


def _guarded(app, token: str):
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        headers = [("WWW-Authenticate", 'Bearer realm="kitchen"'), ("Content-Type", "text/plain")]
        start_response("401 Unauthorized", headers)
        return [b"/metrics needs the launcher's metrics bearer token\n"]

    return guarded


def serve(registry: CollectorRegistry, address: str, token: str = "") -> WSGIServer:
    """Starts serving `registry` on HOST:PORT (port 0: any) in a daemon thread; the server's
    `server_port` is the port, `shutdown()` and `server_close()` stop it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    app = make_wsgi_app(registry)
    if token:
        app = _guarded(app, token)
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, int(port), app, server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kitchen-metrics", daemon=True).start()
    return server
