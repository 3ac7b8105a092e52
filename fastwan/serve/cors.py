"""Cross-origin requests (CORS): web pages served from other origins may call the API only when ``--cors-origin``
names their origins; without it the server sends no CORS header, and browsers keep other origins' pages out.

Rules: an origin is given as a browser sends it in its ``Origin`` header, ``scheme://host[:port]``: scheme http or
https, the host in lowercase (a DNS name, an IPv4 address or a bracketed IPv6 one), a port only when it is not the
scheme's default, nothing after it (no path, not even ``/``); it must match exactly. ``*`` allows every origin and
is given alone. The server never allows credentials (cookies, the browser's own HTTP authentication): a page sends
the key in the ``Authorization`` header itself, which is also why ``*`` is allowed at all; ``*`` without
``--api-key-file`` is warned about (any page a browser opens could use the server). Allowed: the API's methods
(GET, POST, DELETE) and the headers ``Authorization`` and ``Content-Type``; a preflight (OPTIONS) needs no key and
browsers may keep its answer :data:`MAX_AGE_S` seconds.
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit

from fastwan.errors import InvalidArgument

METHODS = ("GET", "POST", "DELETE")
HEADERS = ("Authorization", "Content-Type")
MAX_AGE_S = 600
DEFAULT_PORTS = {"http": 80, "https": 443}
LABEL = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
ORIGIN = re.compile(rf"https?://(?:{LABEL}(?:\.{LABEL})*|\[[0-9a-f:.]+\])(?::[1-9][0-9]{{0,4}})?")
FORM = "scheme://host[:port] with http or https, as the browser's Origin header spells it"


def check_origin(value: str) -> str:
    """One ``--cors-origin`` value, checked (:data:`ORIGIN`); a user error naming the fix."""
    flag = f"--cors-origin {value!r}"
    if value == "*":
        return value
    if value == "null":
        raise InvalidArgument(f"{flag}: the origin 'null' is any page without one (a local file, a sandboxed "
                              "frame): it cannot be allowed safely; serve the page over http(s) and give that origin.")
    parts = urlsplit(value)
    if parts.scheme.lower() not in DEFAULT_PORTS or not parts.netloc or "@" in parts.netloc:
        raise InvalidArgument(f"{flag} is not an origin; give {FORM}, e.g. https://app.example.com or "
                              "http://localhost:5173, or '*' for every origin.")
    base = f"{parts.scheme}://{parts.netloc}"
    if value != base:
        raise InvalidArgument(f"{flag}: an origin has no path, query or fragment (not even '/'); give {base!r}.")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port <= 65535:
        raise InvalidArgument(f"{flag}: the port must be in [1, 65535].")
    if port == DEFAULT_PORTS[parts.scheme.lower()]:
        bare = f"{parts.scheme}://{parts.hostname}" if ":" not in parts.hostname else \
            f"{parts.scheme}://[{parts.hostname}]"
        raise InvalidArgument(f"{flag}: browsers leave out the default port {port} of {parts.scheme}, so it would "
                              f"never match; give {bare.lower()!r}.")
    if value != value.lower():
        raise InvalidArgument(f"{flag}: browsers send the scheme and host in lowercase, so it would never match; "
                              f"give {value.lower()!r}.")
    if not ORIGIN.fullmatch(value):
        raise InvalidArgument(f"{flag} is not an origin; give {FORM} (the host a DNS name, an IPv4 address or a "
                              "bracketed IPv6 one, e.g. https://app.example.com, http://[::1]:8080).")
    return value


def check_origins(values: list[str] | None) -> tuple[str, ...]:
    """The ``--cors-origin`` values, each checked, in order, once each; ``*`` only alone."""
    origins = tuple(dict.fromkeys(check_origin(v) for v in values or ()))
    if "*" in origins and len(origins) > 1:
        raise InvalidArgument("--cors-origin '*' allows every origin, so the other --cors-origin values say nothing; "
                              "give '*' alone, or only the exact origins.")
    return origins


def cors_warning(origins: tuple[str, ...], key: str | None) -> str | None:
    """What to warn of when every web page may call a server without a key (None: nothing)."""
    if "*" not in origins or key is not None:
        return None
    return ("--cors-origin '*' without --api-key-file: any web page a browser on this machine opens can make and "
            "read videos here; give --api-key-file, or name the page's origin.")


def add_cors(app, origins: tuple[str, ...]) -> None:
    """Answer CORS for ``origins`` on every route of ``app`` (nothing when there are none)."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=list(METHODS),
                       allow_headers=list(HEADERS), allow_credentials=False, max_age=MAX_AGE_S)
