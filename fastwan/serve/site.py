"""The web page at ``/``: plain HTML, CSS and JavaScript files from ``fastwan/serve/page`` (package data), read once
when the app is made and served as they are: no build step, nothing fetched from elsewhere.

Rules: the page's files need no key (they hold no data; every API call the page makes sends the key); only the
files named in :data:`FILES` are served, at fixed routes (no path from the request reaches the file system); each
answer carries a Content-Security-Policy that allows this server's own scripts, styles and API calls and ``blob:``
media (the videos, which the page fetches with the key), and refuses everything else, framing included.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

FILES = (("/", "index.html", "text/html; charset=utf-8"),
         ("/page.js", "page.js", "text/javascript; charset=utf-8"),
         ("/page.css", "page.css", "text/css; charset=utf-8"))
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; media-src blob:; "
       "img-src 'self' data: blob:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"), ("X-Frame-Options", "DENY"),
           ("Referrer-Policy", "no-referrer"), ("Cross-Origin-Opener-Policy", "same-origin"),
           ("Cross-Origin-Resource-Policy", "same-origin"), ("Cache-Control", "no-cache"))


def _answer(body: bytes, media_type: str):
    def page() -> Response:
        return Response(body, media_type=media_type, headers=dict(HEADERS))
    return page


def add_page(app: FastAPI) -> None:
    """The page's routes on ``app``, outside the key's check."""
    folder = resources.files("fastwan.serve") / "page"
    for route, name, media_type in FILES:
        app.add_api_route(route, _answer((folder / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)
