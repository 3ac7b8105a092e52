"""Several hosts on one PostgreSQL store and one data folder (a real PostgreSQL; the hosts are processes here):
an API process and two worker processes. A worker killed (SIGKILL) mid-job: the other finishes the job once its
lease lapses, every job completes exactly once, the dead claim's files never show, and the API's content is the
finished video."""
from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time

import imageio.v3 as iio
import pytest

from fastwan.serve.server import open_store
from tests.serve.helpers import START_TIMEOUT, Server, stop_process, wait, wait_started

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LEASE_S = 3


class WorkerProcess:
    """``fastwan serve --role worker`` on the shared store; :meth:`start` waits for its model to load."""

    def __init__(self, tmp, url: str, data_dir, name: str):
        self.log = tmp / f"{name}.log"
        argv = [sys.executable, "-m", "fastwan", "serve", "--role", "worker", "--store", url, "--data-dir",
                str(data_dir), "--device", "cpu", "--lease-seconds", str(LEASE_S)]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)

    def wait_loaded(self) -> WorkerProcess:
        deadline = time.monotonic() + START_TIMEOUT
        while "loaded on" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start ({self.process.poll()}):\n{self.log.read_text()}")
            time.sleep(0.3)
        return self

    def stop(self, sig=signal.SIGTERM) -> None:
        stop_process(self.process, sig, timeout=60)


def test_a_killed_workers_job_is_finished_by_the_other_exactly_once(tmp_path, postgres):
    url = postgres.database()
    data = tmp_path / "shared"
    workers = {}
    api = None
    try:
        for name in ("a", "b"):
            workers[name] = WorkerProcess(tmp_path, url, data, name)
        for worker in workers.values():
            worker.wait_loaded()
        pids = {w.process.pid: name for name, w in workers.items()}
        api = Server(tmp_path, "--role", "api", "--store", url, "--lease-seconds", str(LEASE_S),
                     data_dir=data).start()
        client = api.client()
        long = client.videos.create(prompt="running when its worker dies", size="64x64", seconds="1",
                                    extra_body={"num_inference_steps": 300, "seed": 5})
        wait_started(client, long.id)
        store = open_store(url, data)
        claim = store.get(long.id).claim
        victim = pids[int(claim.split("/")[0].split(":")[1])]  # the claim's owner is host:pid:device
        others = [client.videos.create(prompt=f"job {k}", size="32x32", seconds="0.5",
                                       extra_body={"num_inference_steps": 2}).id for k in range(4)]
        workers[victim].stop(signal.SIGKILL)
        survivor = "b" if victim == "a" else "a"

        done = wait(client, long.id, timeout=240)
        assert done.status == "completed" and done.progress == 100, done.error
        final = store.get(long.id)
        assert final.claim != claim and int(final.claim.split("/")[0].split(":")[1]) == workers[survivor].process.pid
        for video_id in others:
            assert wait(client, video_id, timeout=120).status == "completed"
        frames = iio.imread(io.BytesIO(client.videos.download_content(long.id).read()), extension=".mp4")
        assert frames.shape == (9, 64, 64, 3)

        logs = workers["a"].log.read_text() + workers["b"].log.read_text()
        for video_id in [long.id, *others]:  # each job completed once, on one worker
            assert len(re.findall(rf"video {video_id}: completed", logs)) == 1, video_id
        visible = sorted(p.name for p in (data / "videos").iterdir() if not p.name.startswith("."))
        dead_token = claim.rsplit("/", 1)[1]
        assert not [n for n in visible if dead_token in n]  # the killed claim left nothing visible
        assert sum(n.startswith(long.id) and n.endswith(".mp4") for n in visible) == 1
        assert client.videos.list(limit=100).data and store.counts() == {"completed": 5}
        store.close()
    finally:
        for worker in workers.values():
            worker.stop(signal.SIGKILL)
        if api is not None:
            api.stop()
