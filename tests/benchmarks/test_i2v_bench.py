"""benchmarks.i2v on CPU with tiny checkpoints: both pipelines run the job's code path and produce comparable
frames; argument errors are refused before any work."""
import json

import numpy as np
import pytest

from benchmarks import i2v
from fastwan.checkpoint.tiny import tiny_checkpoint


def test_bench_image_is_deterministic_rgb():
    a, b = i2v.bench_image(48, 80), i2v.bench_image(48, 80)
    assert a.dtype == np.uint8 and a.shape == (48, 80, 3)
    assert np.array_equal(a, b) and a.std() > 20  # not flat: the encoders see edges and gradients


@pytest.mark.parametrize("job,variant,steps,phases", [("i2v-14b", "wan2.1-i2v", 2, ["diffusers,fastwan"]),
                                                      ("i2v-a14b", "wan2.2-i2v-a14b", 6, ["fastwan", "diffusers"])])
def test_phases_on_a_tiny_checkpoint(tmp_path, job, variant, steps, phases):
    """The phases in one process, or in separate ones in either order (the comparison waits for both)."""
    out = tmp_path / "r.json"
    for phase in phases:
        assert i2v.main(["--job", job, "--phase", phase, "--ckpt", str(tiny_checkpoint(variant)), "--device", "cpu",
                         "--video", "64x64x9", "--steps", str(steps), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    peer = res[f"{job}:diffusers"]
    ours = res[f"{job}:fastwan[auto,{steps} steps]"]
    assert peer["steps"] == ours["steps"] == steps and len(peer["s_per_step_spread"]) == 2
    assert ours["vs_diffusers"]["psnr_db"] > 35  # bf16 on both sides: the same video, not bit for bit
    if job == "i2v-a14b":
        assert len(ours["experts"]) == 2 and min(ours["experts"]) > 0 and sum(ours["experts"]) == steps
    else:
        assert ours["experts"] == [steps]


@pytest.mark.parametrize("argv,msg", [(["--video", "480x832"], "HEIGHTxWIDTHxFRAMES"),
                                      (["--video", "0x64x9"], "positive multiples of 16"),
                                      (["--steps", "1"], "at least 2"),
                                      (["--phase", "decode"], "unknown phase")])
def test_bad_arguments_are_refused(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        i2v.main(argv + ["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
