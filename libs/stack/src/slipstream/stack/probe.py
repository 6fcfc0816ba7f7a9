"""Is it up? Loopback probes for the stack's processes: an HTTP status or a TCP connect.

http.client rather than urllib so that no HTTP(S)_PROXY variable reroutes a loopback probe.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any
from urllib.parse import urlsplit

HOST = "127.0.0.1"


def probe_http(port: int, path: str, host: str = HOST, timeout_s: float = 1.0) -> int | None:
    """HTTP status of GET path, or None when nothing answers. http.client, so no proxy env applies."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def get_json(port: int, path: str, host: str = HOST, timeout_s: float = 2.0) -> Any:
    """The JSON body of GET path (whatever its status: /readyz answers 503 with its body), or None."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def probe_tcp(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def url_endpoint(url: str, default_port: int) -> tuple[str, int]:
    """(host, port) of a URL; of its first server when it names several (a cluster, Sentinels)."""
    first = url.split(",", 1)[0]
    parts = urlsplit(first)
    return parts.hostname or HOST, parts.port or default_port
