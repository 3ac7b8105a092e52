"""Bad requests to ``fastwan serve`` get their documented status and OpenAI's error shape, are refused before a job
exists, and leave the server serving: malformed JSON, wrong types, unknown fields, sizes and durations out of range,
paths in fields, no key, a wrong key, an unknown video, a full queue (the server of tests/serve/conftest.py queues
one video at most)."""
from __future__ import annotations

import json
import socket

import openai
import pytest

from tests.serve.helpers import KEY, call, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def error_of(answer, status: int) -> dict:
    got, body = answer
    assert got == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def videos(server) -> list:
    return call("GET", f"{server.url}/v1/videos?limit=100")[1]["data"]


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "a cat", "num_inference_steps": "two"}, "num_inference_steps", "invalid_type"),
    ({"prompt": "a cat", "guidance_scale": [1]}, "guidance_scale", "invalid_type"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"size": "32x32"}, "prompt", "missing_required_parameter"),
    ({"prompt": "a cat", "num_inference_step": 2}, "num_inference_step", "unknown_parameter"),
    ({"prompt": "a cat", "size": "64x100000"}, "size", "invalid_value"),
    ({"prompt": "a cat", "size": "0x32"}, "size", "invalid_value"),
    ({"prompt": "a cat", "size": "big"}, "size", "invalid_value"),
    ({"prompt": "a cat", "size": "36x32"}, "size", "invalid_value"),  # not a multiple of 16
    ({"prompt": "a cat", "seconds": "-1"}, "seconds", "invalid_value"),
    ({"prompt": "a cat", "seconds": "soon"}, "seconds", "invalid_type"),
    ({"prompt": "a cat", "seconds": 1e308}, "seconds", "invalid_value"),  # no frame count is computed from it
    ({"prompt": "a cat", "seconds": "1", "num_frames": 9}, "num_frames", "invalid_value"),
    ({"prompt": "a cat", "output_path": "/etc/cron.d/x.mp4"}, "output_path", "unsupported_parameter"),
    ({"prompt": "a cat", "image": "/etc/passwd"}, "image", "unsupported_parameter"),
    ({"prompt": "a cat", "overwrite": True}, "overwrite", "unsupported_parameter"),
    ({"prompt": "a cat", "mask": "/etc/passwd"}, "mask", "unsupported_parameter"),  # a file of the server's host
    ({"prompt": "a cat", "reference_images": ["/etc/passwd"]}, "reference_images", "unsupported_parameter"),
    ({"prompt": "a cat", "mask": [["/etc/passwd"]]}, "mask", "unsupported_parameter"),
    ({"prompt": "a cat", "input_reference": "/etc/passwd"}, "input_reference", "invalid_value"),
    ({"prompt": "a cat", "model": "sora-2"}, "model", "model_not_found"),
    ({"prompt": "a cat " * 5000}, "prompt", "invalid_value"),  # far past the 512 tokens the text encoder reads
    ({"prompt": "a cat", "negative_prompt": "x" * 10000}, "negative_prompt", "invalid_value"),
    ({"prompt": "a cat", "cache": "bogus"}, "cache", "invalid_value"),
    ({"prompt": "a cat", "cache": "magcache:mag_ratios=@/etc/passwd"}, "cache", "unsupported_parameter"),
    ({"prompt": "a cat", "cache": {"type": "magcache", "mag_ratios": "@/etc/passwd"}}, "cache",
     "unsupported_parameter"),
])
def test_bad_json_bodies_are_400_and_nothing_is_queued(server, body, param, code):
    before = videos(server)
    error = error_of(call("POST", f"{server.url}/v1/videos", body), 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert videos(server) == before


@pytest.mark.parametrize("raw, code", [(b'{"prompt": "a cat",', "invalid_json"), (b"[1, 2]", "invalid_json"),
                                       (b'{"prompt": "a", "prompt": "b"}', "invalid_json"),
                                       (b"\xff\xfe", "invalid_json")])
def test_malformed_json_is_400(server, raw, code):
    assert error_of(call("POST", f"{server.url}/v1/videos", raw), 400)["code"] == code


def test_multipart_text_is_read_as_the_flags_are(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.videos.create(prompt="a cat", size="32x32", extra_body={"num_inference_steps": "2.5"})
    assert exc.value.status_code == 400 and exc.value.body["param"] == "num_inference_steps"
    with pytest.raises(openai.BadRequestError) as exc:
        client.videos.create(prompt="a cat", extra_body={"output_path": "/tmp/x.mp4"})
    assert exc.value.body["param"] == "output_path"


def test_keys(server):
    assert call("GET", f"{server.url}/health", key=None) == (200, {"status": "ok"})  # liveness needs no key
    for key, code in ((None, "missing_api_key"), ("wrong-key", "invalid_api_key"), (KEY + "x", "invalid_api_key")):
        for method, path in (("GET", "/v1/videos"), ("POST", "/v1/videos"), ("GET", "/ready"),
                             ("GET", f"/v1/videos/video_{'0' * 32}/content")):
            body = {"prompt": "a cat"} if method == "POST" else None
            error = error_of(call(method, server.url + path, body, key=key), 401)
            assert (error["code"], error["type"]) == (code, "authentication_error")
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong-key").videos.list()


def test_unknown_video_and_route(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_" + "0" * 32)
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_" + "0" * 32)
    assert error_of(call("GET", f"{server.url}/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(call("GET", f"{server.url}/v1/videos?limit=0"), 400)["param"] == "limit"


def _answer(sock) -> bytes:
    """What the server sent on ``sock``, read up to the end of its JSON error object (or the connection's end)."""
    answer = b""
    while b"}}" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_a_body_over_the_cap_is_413_before_it_is_read(server):
    """A declared length over the cap is answered at once: the client sends none of the 3 MB."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 3000000\r\n\r\n".encode())
        answer = _answer(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_streamed_body_over_the_cap_is_413(server):
    """Without a declared length (chunked), the body is counted as it arrives."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"a" * 65536
        for _ in range(17):  # just over the 1 MiB cap of a JSON body, then nothing: the server has read it all
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        answer = _answer(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"request_too_large"' in body


def test_a_full_queue_is_429_and_the_server_keeps_serving(server):
    client = server.client()
    running = client.videos.create(prompt="long", size="64x64", seconds="1", extra_body={"num_inference_steps": 200})
    wait(client, running.id, until=("in_progress",))
    queued = client.videos.create(prompt="waits", size="32x32", seconds="0.5", extra_body={"num_inference_steps": 1})
    with pytest.raises(openai.RateLimitError) as exc:
        client.videos.create(prompt="one too many", size="32x32", extra_body={"num_inference_steps": 1})
    assert exc.value.status_code == 429 and exc.value.body["code"] == "queue_full"
    client.videos.delete(running.id)
    assert wait(client, queued.id).status == "completed"  # still serving after every refusal above
    assert call("GET", f"{server.url}/ready")[0] == 200
