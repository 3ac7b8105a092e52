"""CORS of ``fastwan serve``: off by default (no Access-Control-Allow-Origin, preflight or not); with
``--cors-origin`` the named origins get it on a preflight (OPTIONS, no key) and on real requests, other origins do
not; malformed origins stop the start with one line."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.serve.helpers import KEY, Server

ALLOWED, ALSO, OTHER = "https://app.example.com", "http://localhost:5173", "https://evil.example.net"


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve-cors"), "--cors-origin", ALLOWED, "--cors-origin", ALSO).start()
    yield srv
    srv.stop()


def answer(method: str, url: str, headers: dict, body: bytes | None = None) -> tuple[int, dict]:
    """(status, headers in lowercase) of one request."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as got:
            return got.status, {k.lower(): v for k, v in got.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}


def preflight(url: str, origin: str, method: str = "POST") -> tuple[int, dict]:
    return answer("OPTIONS", url, {"Origin": origin, "Access-Control-Request-Method": method,
                                   "Access-Control-Request-Headers": "authorization, content-type"})


def listing(url: str, origin: str) -> tuple[int, dict]:
    return answer("GET", url + "/v1/videos", {"Origin": origin, "Authorization": f"Bearer {KEY}"})


def test_no_cors_headers_by_default(server):
    for status, headers in (preflight(server.url + "/v1/videos", ALLOWED), listing(server.url, ALLOWED)):
        assert not any(k.startswith("access-control-") for k in headers), (status, headers)
    assert listing(server.url, ALLOWED)[0] == 200  # the request itself is served; the browser hides the answer


def test_configured_origins_get_cors_headers(cors_server):
    url = cors_server.url
    for origin in (ALLOWED, ALSO):
        status, headers = preflight(url + "/v1/videos", origin)  # no key: a preflight carries none
        assert status == 200, headers
        assert headers["access-control-allow-origin"] == origin
        assert {"GET", "POST", "DELETE"} <= {m.strip() for m in headers["access-control-allow-methods"].split(",")}
        allowed = {h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        assert "access-control-allow-credentials" not in headers
        status, headers = preflight(url + "/v1/videos/video_x", origin, "DELETE")
        assert status == 200 and headers["access-control-allow-origin"] == origin
        status, headers = listing(url, origin)
        assert status == 200 and headers["access-control-allow-origin"] == origin
    status, headers = answer("GET", url + "/v1/videos", {"Origin": ALLOWED})  # an error answer carries it too
    assert status == 401 and headers["access-control-allow-origin"] == ALLOWED


def test_other_origins_get_no_cors_headers(cors_server):
    url = cors_server.url
    for origin in (OTHER, ALLOWED + ":8443", "http://app.example.com"):
        status, headers = preflight(url + "/v1/videos", origin)
        assert status != 200 and "access-control-allow-origin" not in headers, (origin, headers)
        status, headers = listing(url, origin)
        assert status == 200 and "access-control-allow-origin" not in headers, (origin, headers)


@pytest.mark.parametrize("argv, says", [
    (["https://app.example.com/"], "an origin has no path, query or fragment (not even '/'); give "
                                   "'https://app.example.com'"),
    (["https://App.Example.com"], "give 'https://app.example.com'"),
    (["https://app.example.com:443"], "browsers leave out the default port 443 of https"),
    (["app.example.com"], "is not an origin; give scheme://host[:port]"),
    (["ftp://app.example.com"], "is not an origin"),
    (["https://app.example.com:0"], "the port must be in [1, 65535]"),
    (["null"], "the origin 'null' is any page without one"),
    (["*", "https://app.example.com"], "give '*' alone"),
])
def test_malformed_origins_stop_the_start(tmp_path, monkeypatch, capsys, argv, says):
    from fastwan import cli

    monkeypatch.chdir(tmp_path)
    flags = [a for v in argv for a in ("--cors-origin", v)]
    assert cli.main(["serve", "--data-dir", str(tmp_path / "d"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: --cors-origin ") and says in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()  # refused before the store was opened
