"""FA4 from several threads (the server's workers, one model per GPU): calls enter flash_attn.cute one at a time,
since its CuTe DSL compiles kernels on first calls and two threads compiling at once abort the process. A stand-in
flash_attn.cute records how many calls are inside it at once."""
import sys
import threading
import time
import types

import torch

from fastwan.attention.backends import packages


def test_fa4_calls_enter_one_at_a_time(monkeypatch):
    inside, most, guard = [0], [0], threading.Lock()

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)  # long enough for every other thread to arrive
        with guard:
            inside[0] -= 1
        return q * softmax_scale

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    flash = types.ModuleType("flash_attn")
    flash.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    packages.flash_kernel.cache_clear()
    try:
        run = packages.flash_kernel(4)
        q = torch.ones(1, 4, 2, 8)
        start = threading.Barrier(4)
        results = []

        def worker():
            start.wait()
            results.append(run(q, q, q, 0.5))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        packages.flash_kernel.cache_clear()  # drop the stand-in
    assert len(results) == 4 and all(torch.equal(r, q * 0.5) for r in results)
    assert most[0] == 1, f"{most[0]} threads were inside flash_attn.cute at once"
