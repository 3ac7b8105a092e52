"""``gen.generate(request, on_step=fn)``: fn(done, total) after every denoising step, the video unchanged by it, and
an exception it raises ends the call with no file written (the server's progress and cancellation)."""
from __future__ import annotations

import numpy as np
import pytest

from fastwan import GenerationRequest


class Stop(Exception):
    pass


def request(tmp_path, **kw):
    return GenerationRequest(prompt="a red ball", width=32, height=32, num_frames=5, num_inference_steps=3, seed=7,
                             output_path=str(tmp_path / "out"), **kw)


def test_on_step_is_called_after_each_step_and_changes_nothing(gen, tmp_path):
    calls = []
    with_callback = gen.generate(request(tmp_path, save_video=False), on_step=lambda d, t: calls.append((d, t)))
    plain = gen.generate(request(tmp_path, save_video=False))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    np.testing.assert_array_equal(with_callback.frames, plain.frames)


def test_an_exception_from_on_step_stops_the_run_and_writes_nothing(gen, tmp_path):
    calls = []

    def stop_at_two(done, total):
        calls.append(done)
        if done == 2:
            raise Stop

    with pytest.raises(Stop):
        gen.generate(request(tmp_path), on_step=stop_at_two)
    assert calls == [1, 2]  # stopped at the step it raised in: step 3 never ran
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []
    result = gen.generate(request(tmp_path))  # the generator is usable again (its lock released, hooks removed)
    assert result.video_path is not None and list(out.iterdir()) == [out / result.video_path.rsplit("/", 1)[1]]
