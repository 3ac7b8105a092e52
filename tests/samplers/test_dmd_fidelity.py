"""DMD sampling and FastVideo's checkpoint layouts against FastVideo's own rules (hao-ai-lab/FastVideo, read at
2f3d407), with an independent float64 reference written from them:

- ``DmdDenoisingStage`` (fastvideo/pipelines/stages/denoising.py) builds its own
  ``FlowMatchEulerDiscreteScheduler(shift=8.0)`` (fastvideo/models/schedulers/scheduling_flow_match_euler_discrete.py:
  sigma_k = 8 s / (1 + 7 s) for s = k / 1000, k = 1000 .. 1, timesteps 1000 sigma_k), whatever the checkpoint's
  scheduler or the pipeline config's flow_shift say; it reads ``dmd_denoising_steps`` as ``torch.long`` and passes
  t itself to the DiT; ``pred_noise_to_pred_video`` (fastvideo/models/utils.py) takes the sigma of the grid
  timestep nearest t (argmin) and returns x - sigma v; ``add_noise`` re-noises to the next t's nearest sigma with
  fresh noise; the last step returns x0. No CFG.
- FastVideo's pipeline classes (fastvideo/pipelines/basic/wan/): ``WanDMDPipeline`` (text-to-video, no image
  stage), ``WanImageToVideoDmdPipeline`` (image-to-video with the DMD stage), ``WanCausalPipeline`` /
  ``WanCausalDMDPipeline`` (Self-Forcing, a causal DiT ``CausalWanTransformer3DModel``); the pipeline registry finds
  a class by its exact name.

Sampling requests the few-step samplers cannot run are refused before any compute with the value, the rule and the
fix: timesteps that hold no values (a meta tensor), and euler / dmd on a checkpoint whose scheduler counts another
number of training timesteps than the 1000-step grid those samplers place their timesteps on (diffusers'
flow-matching schedulers take sigma = t / num_train_timesteps, so t = 1000 on a 500-step scheduler is past its
pure noise).
"""
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from PIL import Image

from fastwan import VideoGenerator, cli
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType
from fastwan.checkpoint.presets import Preset
from fastwan.checkpoint.resolver import resolve
from fastwan.pipelines.sampling import Schedule, check_sampling
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from tests.pipelines.latents import generate_with_latents
from tests.cli.helpers import assert_one_error_line

PRESET = Preset(64, 64, 9, 8, 1.0, None, 8)
SIZE = dict(height=64, width=64, num_frames=9)
PROMPT = "a red fox runs through snow"


class FastVideoDmd:
    """FastVideo's DmdDenoisingStage as a diffusers-scheduler stand-in for diffusers' Wan pipelines, in float64."""

    order = 1

    def __init__(self, dmd_steps, generator=None, shift: float = 8.0):
        k = torch.arange(1000, 0, -1, dtype=torch.float64)  # FlowMatchEulerDiscreteScheduler.__init__: 1000 .. 1
        s = k / 1000
        self.grid_sigmas = shift * s / (1 + (shift - 1) * s)
        self.grid_timesteps = self.grid_sigmas * 1000
        self.steps = torch.tensor(dmd_steps, dtype=torch.long)  # the stage's torch.tensor(..., dtype=torch.long)
        self.generator = generator
        self.config = SimpleNamespace(num_train_timesteps=1000)

    def sigma(self, t) -> float:  # pred_noise_to_pred_video / add_noise: the grid timestep nearest t
        return self.grid_sigmas[torch.argmin((self.grid_timesteps - float(t)).abs())].item()

    def step_sigmas(self) -> list[float]:
        return [self.sigma(t) for t in self.steps]

    def set_timesteps(self, n, device=None):
        assert n == len(self.steps)
        self.timesteps = self.steps.to(torch.float32).to(device)  # the DiT sees t itself
        self.sigmas = torch.tensor(self.step_sigmas() + [0.0], dtype=torch.float64)  # diffusers' loop reads them
        self.i = 0

    def set_begin_index(self, i=0):
        pass

    def step(self, pred, t, latents, return_dict=False):
        i, self.i = self.i, self.i + 1
        x0 = latents.double() - self.sigma(self.steps[i]) * pred.double()
        if i == len(self.steps) - 1:
            return (x0.to(latents.dtype),)
        nxt = self.sigma(self.steps[i + 1])
        noise = torch.randn(latents.shape, generator=self.generator, dtype=torch.float32).double()
        return (((1 - nxt) * x0 + nxt * noise).to(latents.dtype),)


SCHEDULERS = {
    "unipc-3": lambda: UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                               flow_shift=3.0),
    "flowmatch-5": lambda: FlowMatchEulerDiscreteScheduler(shift=5.0),
    "ddim": lambda: DDIMScheduler(),  # no flow shift at all
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_dmd_grid_is_the_dmd_stages_shift_8_whatever_the_checkpoints_scheduler(scheduler):
    """Without flow_shift (call or preset), the DMD sigmas are those of FastVideo's stage: its shift-8 grid, not the
    checkpoint scheduler's shift (the Wan2.1 repos' UniPC says 3.0; a scheduler without a shift is no error)."""
    ts = [1000, 757, 522, 300, 100, 13]
    sched = Schedule(check_sampling(PRESET, sampler="dmd", timesteps=ts), SCHEDULERS[scheduler](),
                     torch.device("cpu"))
    ref = FastVideoDmd(ts)
    torch.testing.assert_close(torch.tensor(sched.sigmas, dtype=torch.float64),
                               torch.tensor(ref.step_sigmas() + [0.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert sched.timesteps.tolist() == ref.steps.tolist()  # the DiT sees FastVideo's integer t


def test_dmd_on_a_plain_checkpoint_samples_as_fastvideos_stage(tiny_ckpts):
    """sampler="dmd" on the tiny Wan2.1 (UniPC, flow shift 3) without flow_shift: the final latents are those of
    diffusers' WanPipeline driven by the DMD stage's rule (shift-8 grid) -- the shift-3 grid misses them by ~1e-3
    of sigma, far more than the float tolerance."""
    from diffusers import WanPipeline

    path = tiny_ckpts["wan2.1"]
    ts = [1000, 600, 300, 100]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    res, latents = generate_with_latents(gen, PROMPT, sampler="dmd", timesteps=ts, guidance_scale=1.0, seed=7,
                                         save_video=False, **SIZE)
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator("cpu").manual_seed(7)
    pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                       transformer=pipe.transformer, scheduler=FastVideoDmd(ts, g))
    pipe.set_progress_bar_config(disable=True)
    want = pipe(PROMPT, generator=g, output_type="latent", num_inference_steps=len(ts), guidance_scale=1.0,
                **SIZE).frames
    assert res.num_transformer_forwards == len(ts)
    torch.testing.assert_close(latents, want, rtol=0, atol=2e-5)


def test_fastvideos_warped_timesteps_sample_on_their_grid_points():
    """FastVideo's warped DMD schedules (training/distillation_pipeline.py and mlx_runtime/wan22_sample.py:
    cat(scheduler.timesteps, [0])[1000 - t], fractional) are grid points: the DiT sees each warped t and its sigma
    is that grid point's, the rule FastVideo's causal and MLX DMD samplers apply (nearest grid timestep)."""
    shift = 5.0
    k = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000  # FastVideo's float32 grid
    grid = torch.cat([shift * k / (1 + (shift - 1) * k) * 1000, torch.zeros(1)])
    warped = [float(t) for t in grid[1000 - torch.tensor([1000, 757, 522])]]
    assert warped[0] == 1000.0 and warped[1] != int(warped[1])
    sched = Schedule(check_sampling(PRESET, sampler="dmd", timesteps=warped, flow_shift=shift), None,
                     torch.device("cpu"))
    torch.testing.assert_close(sched.timesteps, torch.tensor(warped))
    ref = FastVideoDmd(warped, shift=shift)
    ref_sigmas = [ref.grid_sigmas[torch.argmin((ref.grid_timesteps - t).abs())].item() for t in warped]
    torch.testing.assert_close(torch.tensor(sched.sigmas[:-1], dtype=torch.float64),
                               torch.tensor(ref_sigmas, dtype=torch.float64), rtol=0, atol=1e-12)
    assert abs(sched.sigmas[1] - warped[1] / 1000) < 1e-6  # 0.940, not 0.757


@pytest.mark.parametrize("shift", [5.0, 8.0])
def test_euler_is_lightx2vs_step_distill_scheduler(shift):
    """lightx2v's WanStepDistillScheduler (lightx2v/models/schedulers/wan/step_distill/scheduler.py, ModelTC/LightX2V
    at f8aee98): sigmas = linspace(1, 0, 1001)[:-1] shifted, indexed at 1000 - t for denoising_step_list
    [1000, 750, 500, 250]; the model sees 1000 sigma; x <- x - sigma v (+ sigma_next v before the last step). Its
    Wan2.2 A14B runs switch experts after boundary_step_index 2; fastwan's boundary (0.875 T2V, 0.900 I2V) splits
    the same 4 steps there."""
    steps = [1000, 750, 500, 250]
    grid = torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1]
    grid = shift * grid / (1 + (shift - 1) * grid)
    sig = grid[[1000 - t for t in steps]]
    sched = Schedule(check_sampling(PRESET, sampler="euler", timesteps=steps, flow_shift=shift), None,
                     torch.device("cpu"))
    torch.testing.assert_close(sched.timesteps, (sig * 1000).float())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 4, 4, generator=g)
    want = x.double()
    for i in range(len(steps)):
        v = torch.randn(x.shape, generator=g)
        x = sched.step(v, i, x)
        want = want - sig[i] * v.double() + (sig[i + 1] * v.double() if i < len(steps) - 1 else 0)
    torch.testing.assert_close(x.double(), want, rtol=0, atol=1e-5)
    if shift == 5.0:
        for boundary in (0.875, 0.900):
            assert (sched.timesteps >= boundary * 1000).tolist() == [True, True, False, False]


@pytest.mark.parametrize("timesteps,want", [
    ([1.0, 0.75, 0.5, 0.25], "[1000.0, 750.0, 500.0, 250.0]"),
    ([1.0, 0.5, 0.0], "[1000.0, 500.0]"),  # a scheduler's sigmas with the terminal 0
    (np.array([0.9, 0.4], dtype=np.float32), "[900.0"),
])
@pytest.mark.parametrize("sampler", ["euler", "dmd"])
def test_sigmas_passed_as_timesteps_are_refused_with_the_timesteps_to_pass(no_compute, sampler, timesteps, want):
    """diffusers' flow-matching schedulers and ComfyUI take sigmas in [0, 1]; fastwan's timesteps are the 1000-step
    grid's. A list within [0, 1] from pure noise would sample at the wrong noise level; it is refused."""
    with pytest.raises(InvalidArgument, match="look like sigmas") as e:
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler=sampler, timesteps=timesteps)
    assert f"pass {want}" in str(e.value)


def test_dmd_needs_no_flow_shift_from_the_scheduler(no_compute, monkeypatch):
    """A checkpoint scheduler without a flow shift: euler still needs one, dmd has the DMD stage's."""
    monkeypatch.setattr(no_compute, "scheduler", DDIMScheduler())
    with pytest.raises(InvalidArgument, match="needs a flow_shift"):
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler="euler")
    with pytest.raises(AssertionError, match="compute started"):  # every check passed
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler="dmd", **SIZE)


def relabelled(src, dst, **index_changes):
    """A copy of the checkpoint folder ``src`` (components linked) whose model_index.json has ``index_changes``."""
    dst.mkdir()
    for comp in src.iterdir():
        if comp.name != "model_index.json":
            (dst / comp.name).symlink_to(comp, target_is_directory=comp.is_dir())
    index = json.loads((src / "model_index.json").read_text())
    (dst / "model_index.json").write_text(json.dumps({**index, **index_changes}))
    return dst


def image(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("i2v") / "i2v", "wan2.1-i2v", seed=6)


def test_image_to_video_dmd_pipeline_runs_as_fastvideos_dmd_stage(i2v, tmp_path):
    """FastVideo's ``WanImageToVideoDmdPipeline`` (the image-to-video layout, DmdDenoisingStage): recognised as a
    distilled image-to-video checkpoint with FastVideo's DMD settings, and its latents are those of diffusers'
    WanImageToVideoPipeline driven by the DMD stage's rule at 1000/757/522, no CFG."""
    from diffusers import WanImageToVideoPipeline

    dmd = relabelled(i2v, tmp_path / "dmd", _class_name="WanImageToVideoDmdPipeline")
    ckpt = resolve(dmd)
    p = ckpt.preset
    assert ckpt.distilled and ckpt.needs_image and ckpt.image_encoder
    assert (p.sampler, p.timesteps, p.num_inference_steps, p.guidance_scale, p.flow_shift) == (
        "dmd", (1000.0, 757.0, 522.0), 3, 1.0, 8.0)
    gen = VideoGenerator.from_pretrained(dmd, device="cpu", dtype=torch.float32)
    res, latents = generate_with_latents(gen, PROMPT, image=image(0), seed=5, save_video=False, **SIZE)
    assert res.num_transformer_forwards == 3 and res.settings["sampler"] == "dmd"

    pipe = WanImageToVideoPipeline.from_pretrained(i2v, dtype=torch.float32)
    g = torch.Generator("cpu").manual_seed(5)
    pipe.scheduler = FastVideoDmd([1000, 757, 522], g)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def last_latents(pipe, i, t, tensors):
        seen["z"] = tensors["latents"].detach().clone()
        return {}

    pipe(image=image(0), prompt=PROMPT, output_type="np", generator=g, num_inference_steps=3, guidance_scale=1.0,
         callback_on_step_end=last_latents, **SIZE)
    torch.testing.assert_close(latents, seen["z"], rtol=0, atol=2e-5)
    with pytest.raises(InvalidArgument, match="makes a video from an image"):
        gen.generate_video(PROMPT, seed=5, save_video=False, **SIZE)


@pytest.mark.parametrize("variant", ["wan2.2-ti2v", "wan2.1"])
def test_text_to_video_dmd_pipeline_refuses_an_image(tiny_ckpts, tmp_path, variant):
    """``WanDMDPipeline`` is text-to-video: FastVideo's pipeline has no image stage, and FastWan2.2-TI2V-5B was
    distilled on text-to-video only (FastVideo issues #711, #1153, #864), so an image is refused before compute,
    the TI2V-5B layout included."""
    dmd = relabelled(tiny_ckpts[variant], tmp_path / "dmd", _class_name="WanDMDPipeline")
    gen = VideoGenerator.from_pretrained(dmd, device="cpu", dtype=torch.float32)
    gen._denoise = lambda *a, **k: (_ for _ in ()).throw(AssertionError("compute started"))
    with pytest.raises(InvalidArgument, match=r"DMD-distilled text-to-video.*Drop image="):
        gen.generate_video(PROMPT, image=image(0), seed=1, save_video=False, **SIZE)


@pytest.mark.parametrize("cls,message", [
    ("WanCausalDMDPipeline", 'causal pipeline, whose DiT is "CausalWanTransformer3DModel"'),
    ("WanCausalPipeline", "causal multi-step generation (WanCausalPipeline: a full UniPC schedule per chunk) is not "
                          "supported"),
    ("wandmdpipeline", 'by its exact name, "WanDMDPipeline"'),
    ("WanImageToVideoDMDPipeline", 'by its exact name, "WanImageToVideoDmdPipeline"'),
])
def test_fastvideo_pipelines_fastwan_does_not_run_are_refused_clearly(tiny_ckpts, tmp_path, cls, message):
    dmd = relabelled(tiny_ckpts["wan2.1"], tmp_path / "ckpt", _class_name=cls)
    with pytest.raises(CheckpointError, match=f'"_class_name": "{cls}"') as e:
        resolve(dmd)
    assert message in str(e.value)


def test_a_causal_dit_is_refused_as_causal(tiny_ckpts, tmp_path):
    """A DiT config naming FastVideo's ``CausalWanTransformer3DModel`` (Self-Forcing) says why it cannot load."""
    root = shutil.copytree(tiny_ckpts["wan2.1"], tmp_path / "ckpt")
    cfg_path = root / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "_class_name": "CausalWanTransformer3DModel"}))
    with pytest.raises(CheckpointError, match="is a causal Wan DiT"):
        resolve(root)


# ---- requests the few-step samplers cannot run --------------------------------------------------------------------
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
