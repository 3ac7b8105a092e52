"""One generator shared by threads makes exactly the videos it makes serially (calls are serialized per instance)."""
import threading

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator

SMALL = dict(height=64, width=64, num_frames=5, num_inference_steps=2, save_video=False)
JOBS = [("a cat on a sofa", 1), ("a red kite over a beach", 2), ("a boat at sea", 3), ("snow on a pine", 4)]
ROUNDS = 3


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-a14b"])
def test_threads_match_serial_runs(tiny_ckpts, variant):
    gen = VideoGenerator.from_pretrained(tiny_ckpts[variant], device="cpu", dtype=torch.float32)
    serial = [gen.generate_video(p, seed=s, **SMALL).frames for p, s in JOBS]
    for _ in range(ROUNDS):
        results, errors = [None] * len(JOBS), []
        start = threading.Barrier(len(JOBS))

        def work(i, start=start, results=results, errors=errors):
            try:
                start.wait()
                results[i] = gen.generate_video(JOBS[i][0], seed=JOBS[i][1], **SMALL).frames
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(JOBS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        same = [np.array_equal(r, s) for r, s in zip(results, serial)]
        assert all(same), f"threaded frames differ from serial ones for jobs {same}"


def test_loads_from_threads_at_once(tiny_ckpts):
    """Generators loaded by several threads at once (a server's worker per GPU) load whole: the same weights as a
    load alone, no thread failing on another's half-built modules."""
    path, n = tiny_ckpts["wan2.1"], 4
    alone = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    gens, errors, start = [None] * n, [], threading.Barrier(n)

    def load(i):
        try:
            start.wait()
            gens[i] = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for gen in gens:
        for module in ("text_encoder", "vae"):
            want, got = getattr(alone, module).state_dict(), getattr(gen, module).state_dict()
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), f"{module} differs from a load alone"
        want, got = alone.transformers[0].state_dict(), gen.transformers[0].state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want), "the DiT differs from a load alone"
