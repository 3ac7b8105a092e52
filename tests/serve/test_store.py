"""The job store's rules, the same for SQLite (one process) and a real PostgreSQL (several hosts): ids, order,
claims held by their token, one completion per job, leases that lapse and pass a dead worker's job on, the model a
worker serves, watchers that see every change, and claims that never hand one job to two workers at once."""
from __future__ import annotations

import re
import threading
import time

import pytest

from fastwan.errors import InvalidArgument
from fastwan.serve.server import open_store
from fastwan.serve.store import SqliteStore, new_id
from tests.serve.helpers import free_port


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request, tmp_path):
    """A function that opens the store (again: a second connection, as another process would)."""
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "jobs.sqlite3")
    url = request.getfixturevalue("postgres").database()
    return lambda: open_store(url, tmp_path)


def add(store, n: int, model: str = "tiny") -> list[str]:
    ids = [new_id() for _ in range(n)]
    for i in ids:
        store.add(id=i, model=model, prompt="p", size="32x32", seconds="1", fields={"seed": 1}, image=None)
    return ids


def test_claims_finish_and_delete(opener):
    store = opener()
    ids = add(store, 3)
    assert len(set(ids)) == 3 and all(re.fullmatch(r"video_[0-9a-f]{32}", i) for i in ids)
    first = store.claim("a")
    assert (first.id, first.status) == (ids[0], "in_progress") and first.claim.startswith("a/")
    second = store.claim("b")
    assert second.id == ids[1] and second.claim != first.claim
    assert not store.progress(ids[0], second.claim, 50)  # only the claim that holds a job changes it
    assert store.progress(ids[0], first.claim, 50) and store.get(ids[0]).progress == 50
    assert not store.finish(ids[0], second.claim, video="v.mp4", thumbnail="t.png")
    assert store.finish(ids[0], first.claim, video="v.mp4", thumbnail="t.png")
    assert not store.finish(ids[0], first.claim, video="v.mp4", thumbnail="t.png")  # a job completes once
    done = store.get(ids[0])
    assert (done.status, done.progress, done.video) == ("completed", 100, "v.mp4")
    assert store.release(ids[1], second.claim) and store.get(ids[1]).status == "queued"
    assert store.delete(ids[1]).id == ids[1] and store.get(ids[1]) is None and store.delete(ids[1]) is None
    assert store.claim("a").id == ids[2]  # the deleted queued job is never claimed
    assert store.claim("a") is None
    jobs, more = store.page(10, None, "asc")
    assert [j.id for j in jobs] == [ids[0], ids[2]] and not more
    assert store.counts() == {"completed": 1, "in_progress": 1}
    store.close()


def test_a_lapsed_lease_passes_the_job_on_and_the_old_claim_loses_it(opener):
    store = opener()
    other = opener() if store.shared else store  # another process's connection, where the store allows one
    ids = add(store, 1)
    dead = store.claim("dead", lease_s=1.0)
    time.sleep(0.6)
    assert store.heartbeat(ids[0], dead.claim)  # renewed: not claimable yet
    time.sleep(0.6)
    assert other.claim("alive", lease_s=1.0) is None
    time.sleep(1.2)  # no heartbeat for a whole lease
    taken = other.claim("alive", lease_s=1.0)
    assert taken.id == ids[0] and taken.claim.startswith("alive/") and taken.progress == 0
    assert not store.heartbeat(ids[0], dead.claim) and not store.progress(ids[0], dead.claim, 90)
    assert not store.finish(ids[0], dead.claim, video="dead.mp4")
    assert other.finish(ids[0], taken.claim, video="alive.mp4")
    assert store.get(ids[0]).video == "alive.mp4"
    for s in {store, other}:
        s.close()


def test_a_worker_claims_only_its_model(opener):
    store = opener()
    wan = add(store, 1, model="wan")
    tiny = add(store, 1, model="tiny")
    assert store.claim("w", model="tiny").id == tiny[0]
    assert store.claim("w", model="tiny") is None
    assert store.claim("w", model="wan").id == wan[0]
    store.close()


def test_watchers_see_every_change_in_order(opener):
    store = opener()
    ids = add(store, 1)
    seen = []
    assert store.watch(ids[0], seen.append).status == "queued"
    job = store.claim("w")
    for percent in (10, 20, 30):
        store.progress(ids[0], job.claim, percent)
    store.finish(ids[0], job.claim, video="v.mp4")
    store.delete(ids[0])
    assert [(j.status, j.progress) if j else None for j in seen] == [
        ("in_progress", 0), ("in_progress", 10), ("in_progress", 20), ("in_progress", 30), ("completed", 100), None]
    store.close()


def test_concurrent_claims_hand_each_job_to_one_worker(opener):
    """Four workers (each with its own connection where the store allows) claim 40 jobs at once: every job is
    claimed exactly once."""
    first = opener()
    ids = add(first, 40)
    stores = [first] + ([opener() for _ in range(3)] if first.shared else [first] * 3)
    claimed: list[list[str]] = [[] for _ in stores]

    def work(k: int) -> None:
        while (job := stores[k].claim(f"w{k}")) is not None:
            claimed[k].append(job.id)
            assert stores[k].finish(job.id, job.claim, video="v.mp4")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [i for c in claimed for i in c]
    assert sorted(everything) == sorted(ids)
    assert first.counts() == {"completed": 40}
    for s in set(stores):
        s.close()


def test_sqlite_requeues_at_a_restart_and_serves_one_process(tmp_path):
    store = SqliteStore(tmp_path / "jobs.sqlite3")
    ids = add(store, 2)
    store.claim("w")
    with pytest.raises(InvalidArgument, match="in use by another fastwan serve"):
        SqliteStore(tmp_path / "jobs.sqlite3")
    store.close()
    store = SqliteStore(tmp_path / "jobs.sqlite3")  # a restart: the running job is queued again, first in line
    assert store.requeue() == [ids[0]]
    assert store.claim("w").id == ids[0]
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_store_urls_are_checked_and_errors_hide_the_password(tmp_path):
    with pytest.raises(InvalidArgument, match="not a PostgreSQL URL"):
        open_store("mysql://u@h/db", tmp_path)
    port = free_port()  # nothing listens there
    with pytest.raises(InvalidArgument, match="cannot connect") as caught:
        open_store(f"postgresql://fastwan:s3cret@127.0.0.1:{port}/fastwan", tmp_path)
    assert "s3cret" not in str(caught.value) and f"postgresql://fastwan@127.0.0.1:{port}/fastwan" in str(caught.value)


def test_a_worker_that_lost_its_claim_leaves_the_job_to_the_new_claim(tmp_path):
    """A job fails on a worker whose lease lapsed meanwhile (another worker claimed it): the failure is not
    recorded and the job's upload stays for the new claim; a failure under a held claim is recorded."""
    from PIL import Image

    from fastwan.serve.worker import Worker

    store = SqliteStore(tmp_path / "jobs.sqlite3")
    (tmp_path / "uploads").mkdir()
    upload = tmp_path / "uploads" / "first.img"
    Image.new("RGB", (8, 8)).save(upload, format="PNG")
    video_id = new_id()
    store.add(id=video_id, model="tiny", prompt="p", size="32x32", seconds="1", fields={"prompt": "p", "seed": 1},
              image=str(upload))

    class Failing:
        device = "cpu"
        taken: list = []

        def generate(self, request, on_step=None):
            if not self.taken:  # the first run: its lease lapses and another worker claims the job
                self.taken.append(store.claim("other", lease_s=0.0))
            raise RuntimeError("out of memory")

    worker = Worker(None, store, tmp_path)
    worker.gen = Failing()
    job = store.claim("this")
    time.sleep(0.05)
    worker.run(job)
    row = store.get(video_id)
    assert row.status == "in_progress" and row.claim == Failing.taken[0].claim and upload.is_file()
    worker.run(Failing.taken[0])  # the new claim fails for real: recorded, its upload removed
    assert store.get(video_id).status == "failed" and not upload.exists()
    store.close()
