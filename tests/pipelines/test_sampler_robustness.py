"""Sampling requests the few-step samplers cannot run, refused before any compute with the value, the rule and the
fix: timesteps that hold no values (a meta tensor), and euler / dmd on a checkpoint whose scheduler counts another
number of training timesteps than the 1000-step grid those samplers place their timesteps on (diffusers'
flow-matching schedulers take sigma = t / num_train_timesteps, so t = 1000 on a 500-step scheduler is past its
pure noise)."""
import json
import shutil

import pytest
import torch

from fastwan import VideoGenerator, cli
from fastwan.errors import InvalidArgument, InvalidArgumentType
from tests.cli.helpers import assert_one_error_line

PROMPT = "a red fox runs through snow"
SIZE = dict(height=64, width=64, num_frames=9)


@pytest.mark.parametrize("sampler", ["euler", "dmd"])
def test_meta_tensor_timesteps_are_refused_naming_the_tensor(no_compute, sampler):
    timesteps = torch.tensor([1000.0, 757.0, 522.0], device="meta")
    with pytest.raises(InvalidArgumentType) as e:
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler=sampler, timesteps=timesteps)
    msg = str(e.value)
    assert msg.startswith("timesteps=tensor(") and "meta" in msg and "no values" in msg and "[1000, 757, 522]" in msg


def rescheduled(src, dst, num_train_timesteps: int):
    """A copy of the checkpoint folder ``src`` whose scheduler counts ``num_train_timesteps`` training steps."""
    dst = shutil.copytree(src, dst)
    path = dst / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_train_timesteps": num_train_timesteps}))
    return dst


@pytest.fixture(scope="module")
def other_grid(tiny_ckpts, tmp_path_factory):
    """The tiny Wan2.1 checkpoint with a 500-step scheduler, and a generator of it with compute forbidden."""
    path = rescheduled(tiny_ckpts["wan2.1"], tmp_path_factory.mktemp("grid") / "ckpt", 500)
    return path, VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("kw", [dict(sampler="euler", timesteps=[1000, 500]), dict(sampler="dmd"),
                                dict(sampler="euler", timesteps=[400, 200], flow_shift=5.0)])
def test_euler_and_dmd_on_a_scheduler_of_another_grid_are_refused(other_grid, forbid_compute, kw):
    gen = forbid_compute(other_grid[1])
    with pytest.raises(InvalidArgument) as e:
        gen.generate_video(PROMPT, seed=0, save_video=False, **SIZE, **kw)
    msg = str(e.value)
    assert f"sampler={kw['sampler']!r}" in msg and "num_train_timesteps=500" in msg and "1000" in msg
    assert "sampler='default'" in msg


def test_the_default_sampler_still_runs_on_a_scheduler_of_another_grid(other_grid):
    res = other_grid[1].generate_video(PROMPT, seed=0, save_video=False, num_inference_steps=2, **SIZE)
    assert res.num_transformer_forwards == 4 and res.frames.std() > 5  # 2 steps, CFG


def test_cli_refuses_euler_on_a_scheduler_of_another_grid_before_loading(other_grid, tmp_path, capsys, monkeypatch):
    def loads(*a, **k):
        raise AssertionError("the model loaded before the arguments were checked")
    monkeypatch.setattr(VideoGenerator, "from_pretrained", loads)
    rc = cli.main(["generate", "--prompt", PROMPT, "--model", str(other_grid[0]), "--output", str(tmp_path / "v.mp4"),
                   "--sampler", "euler", "--timesteps", "1000,750,500,250", "--flow-shift", "5"])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err,
                          ["--sampler 'euler'", "num_train_timesteps=500", "--sampler 'default'"],
                          "euler on a 500-step scheduler")


@pytest.mark.parametrize("timesteps,want", [([1000, 750, 500, 250, 0], "[1000.0, 750.0, 500.0, 250.0]"),
                                            ([999.5, 0.0], "[999.5]"),
                                            (torch.tensor([1000, 500, 0]), "[1000.0, 500.0]")])
def test_timesteps_written_with_their_end_point_0_name_the_timesteps_to_pass(no_compute, timesteps, want):
    with pytest.raises(InvalidArgument) as e:
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler="euler", timesteps=timesteps)
    msg = str(e.value)
    assert "0.0 is outside (0, 1000]" in msg and f"drop the final 0 and pass {want}." in msg


@pytest.mark.parametrize("timesteps", [[500, 1000, 0], [1000, 0, 0], [1000, -1, 0]])
def test_other_bad_timesteps_ending_in_0_get_no_list_to_pass(no_compute, timesteps):
    """The list to pass is named only when dropping the 0 leaves valid timesteps."""
    with pytest.raises(InvalidArgument) as e:
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler="dmd", timesteps=timesteps)
    assert "drop the final 0" not in str(e.value)


@pytest.mark.parametrize("text,item", [("1000,757,522,", "item 4 of 4 is empty"), ("1000,,500", "item 2 of 3 is empty"),
                                       ("1000 757 522", "item 1 of 1 '1000 757 522' is not a number"),
                                       ("1000,abc", "item 2 of 2 'abc' is not a number"), ("", "item 1 of 1 is empty")])
def test_cli_timesteps_errors_name_the_item(tmp_path, capsys, text, item):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", PROMPT, "--output", str(tmp_path / "v.mp4"), "--timesteps", text])
    assert e.value.code == 2
    assert_one_error_line(capsys.readouterr().err, [repr(text), item, "separated by commas, e.g. 1000,757,522"], text)
