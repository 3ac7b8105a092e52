"""benchmarks.editing_e2e's pieces on the CPU: the random checkpoints' layout is that of fastwan's tiny VACE and
Animate checkpoints (which both pipelines load), the inputs are deterministic at the job's sizes, and bad arguments
are refused before any work. The phases themselves run in tests/benchmarks/test_smoke.py."""
import json

import numpy as np
import pytest

from benchmarks import editing_e2e
from benchmarks.checkpoints import model_index
from fastwan.checkpoint.tiny import tiny_checkpoint


@pytest.mark.parametrize("task,variant", [("vace", "wan2.1-vace"), ("animate", "wan2.2-animate")])
def test_model_index_is_the_tiny_layout(task, variant):
    want = json.loads((tiny_checkpoint(variant) / "model_index.json").read_text())
    assert model_index(task) == want


def test_inputs_are_deterministic_at_the_job_size():
    a, b = editing_e2e.smooth_video(9, 48, 80, seed=3), editing_e2e.smooth_video(9, 48, 80, seed=3)
    assert a.dtype == np.uint8 and a.shape == (9, 48, 80, 3) and np.array_equal(a, b)
    assert a.std() > 10 and not np.array_equal(a[0], a[1])  # content that moves
    m = editing_e2e.box_mask(5, 32, 48)
    assert set(np.unique(m)) == {0, 255} and m[:, 16, 24].min() == 255 and m[:, 0, 0].max() == 0


def test_animate_face_is_at_the_motion_encoder_size():
    root = tiny_checkpoint("wan2.2-animate")
    size = json.loads((root / "transformer" / "config.json").read_text())["motion_encoder_size"]
    kw = editing_e2e.job_inputs("animate-14b", root, (32, 48, 5))
    assert kw["face_video"].shape == (5, size, size, 3) and kw["pose_video"].shape == (5, 32, 48, 3)
    assert kw["image"].shape == (32, 48, 3)


@pytest.mark.parametrize("argv,msg", [(["--text-encoder-from", "{tmp}/none"], "no text_encoder folder there"),
                                      (["--video", "480x832x80"], "frames 4k + 1"),
                                      (["--job", "animate-14b", "--steps", "1"], "at least 2")])
def test_bad_arguments_are_refused(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        editing_e2e.main([x.format(tmp=tmp_path) for x in argv] + ["--ckpt", str(tmp_path / "c"), "--out",
                                                                   str(tmp_path / "r.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
