"""GPU (two or more): a generator on cuda:1 makes from any thread the video it makes on cuda:0, though a thread's
current CUDA device is cuda:0 until set (Triton kernels launch on the current device); two generators on two GPUs
run at once from two threads (a server's worker per GPU)."""
import threading

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
SMALL = dict(height=64, width=64, num_frames=9, num_inference_steps=3, save_video=False)


def test_generators_on_two_gpus_from_any_thread(tiny_ckpts):
    gens = [VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device=f"cuda:{k}") for k in (0, 1)]
    assert torch.cuda.current_device() == 0
    want = gens[0].generate_video("a lighthouse", seed=5, **SMALL).frames
    got = gens[1].generate_video("a lighthouse", seed=5, **SMALL).frames  # from this thread, device 0 current
    assert torch.cuda.current_device() == 0 and np.array_equal(got, want)
    results, errors = [None, None], []

    def run(k):
        try:
            results[k] = gens[k].generate_video("a lighthouse", seed=5, **SMALL).frames
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(np.array_equal(r, want) for r in results)
