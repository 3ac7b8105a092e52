"""``--keep-days``: a finished video says when it expires (``expires_at``) and is deleted with its files once that
time has passed; the server keeps serving."""
from __future__ import annotations

import re
import time

import pytest

from tests.serve.helpers import Server, call, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
KEEP_DAYS = 3 / 86400  # three seconds


def test_finished_videos_expire_with_their_files(tmp_path):
    server = Server(tmp_path, "--keep-days", repr(KEEP_DAYS)).start()
    try:
        client = server.client()
        video = client.videos.create(prompt="short-lived", size="32x32", seconds="0.5",
                                     extra_body={"num_inference_steps": 1})
        assert video.expires_at is None  # not finished yet
        done = wait(client, video.id)
        assert done.status == "completed" and done.expires_at == done.completed_at + 3
        names = sorted(p.name for p in (server.data_dir / "videos").iterdir())
        assert [re.sub(r"-[0-9a-f]{16}\.", ".", n) for n in names] == [f"{video.id}.mp4", f"{video.id}.png"]
        deadline = time.monotonic() + 30
        while call("GET", f"{server.url}/v1/videos/{video.id}")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert time.time() >= done.expires_at
        assert call("GET", f"{server.url}/v1/videos/{video.id}")[0] == 404
        assert not list((server.data_dir / "videos").iterdir())
        assert f"video {video.id}: deleted (kept" in server.log.read_text()
        assert call("GET", f"{server.url}/ready")[0] == 200
    finally:
        server.stop()
