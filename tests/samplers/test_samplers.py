"""Few-step samplers (euler, dmd) and distilled checkpoints (FastWan) against an independent reference, and the
forms ``timesteps`` may take.

The reference is diffusers' WanPipeline (its own text encoding, expert switch and decode) driven by a scheduler
written here from the published update rules, computed in float64:

- Euler, as lightx2v's step-distill scheduler: sigma_i = shift * s / (1 + (shift - 1) * s), s = t_i / 1000; the
  model sees 1000 * sigma_i; x <- x + (sigma_{i+1} - sigma_i) * v, sigma_N = 0.
- DMD, as FastVideo's DMD stage: the model sees t_i; sigma_i is the shifted 1000-step grid's sigma nearest t_i
  (shift 8, the stage's own, unless flow_shift is given);
  x0 = x - sigma_i * v; x <- (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise, noise drawn from the request's
  generator after the initial latents; the last step gives x0.

One step of each sampler is also checked alone: euler against diffusers' FlowMatchEulerDiscreteScheduler (its
sigmas set to t_i / 1000 with the same shift), dmd against the rule above in float64 (fresh noise from the
request's generator).
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from fastwan.checkpoint.presets import Preset
from fastwan.pipelines.sampling import Schedule, check_sampling

SIZE = dict(height=64, width=64, num_frames=9)
PROMPT = "a red fox runs through snow"


class ReferenceSampler:
    """A diffusers-scheduler stand-in for WanPipeline that applies one rule in float64."""

    order = 1

    def __init__(self, rule: str, timesteps, shift: float, generator: torch.Generator):
        self.rule, self.ts, self.shift, self.generator = rule, [float(t) for t in timesteps], shift, generator
        self.config = SimpleNamespace(num_train_timesteps=1000)

    def set_timesteps(self, n, device=None):
        assert n == len(self.ts)
        shift = self.shift
        if self.rule == "euler":
            sig = [shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in self.ts]
            model_t = [1000 * s for s in sig]
        else:
            grid = [shift * (k / 1000) / (1 + (shift - 1) * (k / 1000)) for k in range(1, 1001)]
            sig = [min(grid, key=lambda g: abs(1000 * g - t)) for t in self.ts]
            model_t = self.ts
        self.sigmas = torch.tensor(sig + [0.0], dtype=torch.float64)
        self.timesteps = torch.tensor(model_t, dtype=torch.float32, device=device)
        self.i = 0

    def set_begin_index(self, i=0):
        pass

    def step(self, pred, t, latents, return_dict=False):
        i, self.i = self.i, self.i + 1
        s, nxt = self.sigmas[i].item(), self.sigmas[i + 1].item()
        v, x = pred.double(), latents.double()
        if self.rule == "euler":
            out = x + (nxt - s) * v
        else:
            x0 = x - s * v
            if i == len(self.ts) - 1:
                out = x0
            else:
                noise = torch.randn(latents.shape, generator=self.generator, dtype=torch.float32).double()
                out = (1 - nxt) * x0 + nxt * noise
        return (out.to(latents.dtype),)


def reference_frames(path, rule, timesteps, shift, seed, **kw):
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator("cpu").manual_seed(seed)
    pipe = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                       transformer=pipe.transformer, transformer_2=pipe.transformer_2,
                       scheduler=ReferenceSampler(rule, timesteps, shift, g),
                       boundary_ratio=pipe.config.boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, generator=g, output_type="np", num_inference_steps=len(timesteps), **SIZE, **kw).frames[0]
    return (out * 255).round().astype(np.uint8)


def close(frames, want):
    assert frames.shape == want.shape and want.std() > 5
    return np.abs(frames.astype(int) - want.astype(int)).max() <= 1


CASES = [  # variant, sampler, timesteps (None: the sampler's own), flow_shift (None: the scheduler's), guidance
    ("wan2.1", "euler", [1000, 750, 500, 250], 5.0, 1.0),
    ("wan2.1", "euler", None, None, 1.0),  # 3 evenly spaced steps at the checkpoint's shift (3.0)
    ("wan2.1", "dmd", [1000, 757, 522], 8.0, 1.0),
    ("wan2.1", "dmd", [999, 600, 300, 100], None, 3.0),  # with CFG, at the DMD stage's own shift (8)
    ("wan2.2-a14b", "euler", [1000, 900, 750, 500], 5.0, 1.0),  # crosses the expert boundary (875)
]


@pytest.mark.parametrize("variant,sampler,timesteps,shift,guidance", CASES)
def test_sampler_matches_float64_reference(tiny_ckpts, variant, sampler, timesteps, shift, guidance):
    path = tiny_ckpts[variant]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    kw = {} if timesteps is not None else {"num_inference_steps": 3}
    res = gen.generate_video(PROMPT, sampler=sampler, timesteps=timesteps, flow_shift=shift, seed=5,
                             guidance_scale=guidance, save_video=False, **SIZE, **kw)
    ts = timesteps or [1000, 1000 * 2 / 3, 1000 / 3]
    default_shift = 8.0 if sampler == "dmd" else 3.0  # FastVideo's DMD stage's; euler: the scheduler's (UniPC 3.0)
    want = reference_frames(path, sampler, ts, default_shift if shift is None else shift, 5, guidance_scale=guidance,
                            **({"guidance_scale_2": guidance} if variant == "wan2.2-a14b" else {}))
    assert res.settings["sampler"] == sampler and res.settings["num_inference_steps"] == len(ts)
    assert res.num_transformer_forwards == len(ts) * (2 if guidance > 1 else 1)
    assert close(res.frames, want)


@pytest.fixture(scope="module")
def fastwan_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fw") / "fastwan", "fastwan2.1", seed=3)


def test_fastwan_checkpoint_gets_fastvideo_settings(fastwan_ckpt):
    """A WanDMDPipeline checkpoint whose DiT carries VSA gates: DMD at 1000/757/522 (shift 8), no CFG (no
    negative prompt encoded), VSA at 0.8 with 4x4x4 tiles, the gates loaded."""
    from safetensors.torch import load_file

    gen = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32)
    p = gen.preset
    assert (p.sampler, p.timesteps, p.flow_shift, p.num_inference_steps, p.guidance_scale) == (
        "dmd", (1000.0, 757.0, 522.0), 8.0, 3, 1.0)
    vsa = gen.attention.self_backend
    assert vsa.name == "VIDEO_SPARSE_ATTN" and vsa.sparsity == 0.8 and tuple(vsa.tile) == (4, 4, 4)
    state = load_file(str(fastwan_ckpt / "transformer" / "diffusion_pytorch_model.safetensors"))
    gate = gen.transformers[0].blocks[1].attn1.to_gate_compress
    assert torch.equal(gate.weight, state["blocks.1.to_gate_compress.weight"])  # FastVideo's name
    encoded = []
    real = gen.text_encoder.forward
    gen.text_encoder.forward = lambda *a, **k: encoded.append(a[0].shape if a else k["input_ids"].shape) or real(*a,
                                                                                                              **k)
    res = gen.generate_video(PROMPT, seed=1, save_video=False, **SIZE)
    assert res.num_transformer_forwards == 3 and encoded[0][0] == 1  # the prompt only

    # the user overrides each setting
    over = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32,
                                          attention_config={"sparsity": 0.5})
    assert over.attention.self_backend.sparsity == 0.5 and tuple(over.attention.self_backend.tile) == (4, 4, 4)
    dense = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32,
                                           attention_backend="TORCH_SDPA")
    assert dense.attention.self_backend.name == "TORCH_SDPA"
    res4 = dense.generate_video(PROMPT, seed=1, save_video=False, num_inference_steps=4, **SIZE)
    assert res4.settings["timesteps"] is None and res4.num_transformer_forwards == 4  # evenly spaced


def test_fastwan_default_yields_to_an_attention_backend_context(fastwan_ckpt):
    """An ``attention_backend()`` context is a request like the argument: it replaces the trained VSA default;
    naming VIDEO_SPARSE_ATTN there keeps the trained tile and sparsity."""
    from fastwan.attention import attention_backend

    with attention_backend("TORCH_SDPA"):
        dense = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32)
    assert dense.attention.self_backend.name == "TORCH_SDPA"
    with attention_backend("video_sparse_attn"):
        vsa = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32).attention.self_backend
    assert vsa.name == "VIDEO_SPARSE_ATTN" and vsa.sparsity == 0.8 and tuple(vsa.tile) == (4, 4, 4)


def test_fastwan_default_is_logged_as_the_checkpoints_and_foreign_settings_are_refused(fastwan_ckpt, caplog):
    """The trained VSA default is reported as the checkpoint's choice, not as the user's argument; settings of
    another backend with no backend named are refused before weights load, naming the keys and the default."""
    import logging

    from fastwan.errors import InvalidArgument

    caplog.set_level(logging.INFO, logger="fastwan")
    VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32)
    assert "VIDEO_SPARSE_ATTN (" in caplog.text and "requested by the checkpoint" in caplog.text
    assert "requested by attention_backend=" not in caplog.text
    with pytest.raises(InvalidArgument, match=r"\['kernel_size'\] are not settings of VIDEO_SPARSE_ATTN.*by default"):
        VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", attention_config={"kernel_size": [3, 3, 3]})
    nat = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32,
                                         attention_backend="NEIGHBORHOOD_ATTN",
                                         attention_config={"kernel_size": [3, 3, 3]})
    assert nat.attention.self_backend.name == "NEIGHBORHOOD_ATTN"


def test_fastwan_dense_matches_reference(fastwan_ckpt):
    """With dense attention the FastWan layout samples exactly as the DMD reference (gates unused)."""
    gen = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32,
                                         attention_backend="TORCH_SDPA")
    res = gen.generate_video(PROMPT, seed=9, save_video=False, **SIZE)
    assert close(res.frames, reference_frames(fastwan_ckpt, "dmd", [1000, 757, 522], 8.0, 9, guidance_scale=1.0))


def test_vsa_gates_change_the_output(fastwan_ckpt):
    """Under VSA the checkpoint's gates weigh the coarse branch: zeroing them changes the video."""
    gen = VideoGenerator.from_pretrained(fastwan_ckpt, device="cpu", dtype=torch.float32)
    a = gen.generate_video(PROMPT, seed=2, save_video=False, **SIZE).frames
    for blk in gen.transformers[0].blocks:
        blk.attn1.to_gate_compress.weight.zero_()
        blk.attn1.to_gate_compress.bias.zero_()
    b = gen.generate_video(PROMPT, seed=2, save_video=False, **SIZE).frames
    assert np.abs(a.astype(int) - b.astype(int)).max() > 2


BAD = [
    (dict(sampler="lcm"), InvalidArgument, "sampler='lcm' is not one of"),
    (dict(sampler=3), InvalidArgumentType, "sampler=3"),
    (dict(sampler="dmd", timesteps=[1000, 1000, 500]), InvalidArgument, "strictly decreasing"),
    (dict(sampler="euler", timesteps=[500, 750]), InvalidArgument, "strictly decreasing"),
    (dict(sampler="dmd", timesteps=[1200, 500]), InvalidArgument, "1200.0 is outside (0, 1000]"),
    (dict(sampler="dmd", timesteps=[500, 0]), InvalidArgument, "outside (0, 1000]"),
    (dict(sampler="dmd", timesteps=[]), InvalidArgumentType, "non-empty"),
    (dict(sampler="dmd", timesteps="1000,500"), InvalidArgumentType, "list of numbers"),
    (dict(sampler="dmd", timesteps=[1000, float("nan")]), InvalidArgument, "outside"),
    (dict(timesteps=[1000, 500]), InvalidArgument, "need sampler='euler' or 'dmd'"),
    (dict(sampler="euler", timesteps=[1000, 500], num_inference_steps=3), InvalidArgument, "disagrees"),
    (dict(sampler="euler", flow_shift=0), InvalidArgument, "flow_shift=0"),
    (dict(sampler="euler", flow_shift=True), InvalidArgumentType, "flow_shift=True"),
    (dict(num_inference_steps=0, sampler="dmd"), InvalidArgument, "num_inference_steps=0"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD)
def test_bad_sampling_raises_before_compute(no_compute, kw, exc, msg):
    with pytest.raises(exc) as e:
        no_compute.generate_video(PROMPT, seed=0, save_video=False, **kw)
    assert msg in str(e.value)


@pytest.mark.parametrize("rule,shift", [("dmd", 8.0), ("dmd", 3.0), ("euler", 5.0)])
def test_schedule_sigmas_match_the_rule(rule, shift):
    """The sigmas themselves (the DMD grid snap is below a uint8 step on the frames): near 0 the shift-8 grid is
    coarse, so t = 13 maps to the grid's 0.0158, not 0.013."""
    from fastwan.checkpoint.presets import Preset
    from fastwan.pipelines.sampling import Schedule

    ts = [1000, 757, 522, 13]
    ref = ReferenceSampler(rule, ts, shift, None)
    ref.set_timesteps(len(ts))
    s = Preset(64, 64, 9, len(ts), 1.0, None, 8, rule, tuple(float(t) for t in ts), shift)
    sched = Schedule(s, None, torch.device("cpu"))
    assert torch.allclose(torch.tensor(sched.sigmas, dtype=torch.float64), ref.sigmas, rtol=0, atol=1e-12)
    assert torch.allclose(sched.timesteps, ref.timesteps)
    if rule == "dmd" and shift == 8.0:
        assert abs(sched.sigmas[3] - 0.013) > 2e-3


@pytest.mark.parametrize("variant,shift", [("wan2.2-a14b", 8.0), ("wan2.2-ti2v", 8.0)])
def test_dmd_pipeline_of_another_wan_kind_gets_dmd_defaults(tiny_ckpts, tmp_path, variant, shift):
    """A WanDMDPipeline whose DiT is not FastWan's Wan2.1 layout (the two A14B experts; TI2V-5B, FastWan2.2) still
    samples with DMD: 3 steps at 1000/757/522, no CFG in either expert; no VSA gates, so dense attention. The
    shift is FastVideo's DMD stage's for every kind, 8: its DmdDenoisingStage builds FlowMatchEulerDiscreteScheduler
    (shift=8.0) itself, so FastWan2_2_TI2V_5B_Config's flow_shift 5.0 never reaches the DMD steps."""
    import json

    from fastwan.checkpoint.resolver import resolve

    src = tiny_ckpts[variant]
    dst = tmp_path / "dmd"
    dst.mkdir()
    for comp in src.iterdir():
        if comp.name != "model_index.json":
            (dst / comp.name).symlink_to(comp, target_is_directory=comp.is_dir())
    index = json.loads((src / "model_index.json").read_text())
    (dst / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanDMDPipeline"}))
    ckpt = resolve(dst)
    p = ckpt.preset
    assert ckpt.distilled and not ckpt.vsa_gates
    assert (p.sampler, p.timesteps, p.num_inference_steps, p.guidance_scale, p.guidance_scale_2, p.flow_shift) == (
        "dmd", (1000.0, 757.0, 522.0), 3, 1.0, None, shift)


def test_euler_without_any_flow_shift_raises_before_compute(no_compute, monkeypatch):
    from diffusers import DDIMScheduler

    monkeypatch.setattr(no_compute, "scheduler", DDIMScheduler())
    with pytest.raises(InvalidArgument, match="needs a flow_shift"):
        no_compute.generate_video(PROMPT, seed=0, save_video=False, sampler="euler")
    with pytest.raises(InvalidArgument, match="has no flow shift"):
        no_compute.generate_video(PROMPT, seed=0, save_video=False, flow_shift=3.0)


# ---- one step of each sampler, and the forms of timesteps ---------------------------------------------------------
PRESET = Preset(64, 64, 9, 8, 5.0, None, 8)


def schedule(**kw) -> Schedule:
    return Schedule(check_sampling(PRESET, **kw), None, torch.device("cpu"), torch.Generator().manual_seed(3))


@pytest.mark.parametrize("shift", [0.5, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("timesteps", [[1000, 757, 522, 13], [1000], [640.5, 2.25]])
def test_euler_steps_match_diffusers_flow_match_euler(shift, timesteps):
    ours = schedule(sampler="euler", timesteps=timesteps, flow_shift=shift)
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(sigmas=[t / 1000 for t in timesteps])
    torch.testing.assert_close(ours.timesteps, ref.timesteps.float(), rtol=1e-6, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    x = want = torch.randn(1, 4, 2, 4, 4, generator=g)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(x.shape, generator=g)
        x = ours.step(v, i, x)
        want = ref.step(v, t, want, return_dict=False)[0]
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("timesteps,shift", [([1000, 757, 522], 8.0), ([999.5], 3.0), ([700, 30, 1], 5.0)])
def test_dmd_steps_match_the_float64_rule(timesteps, shift):
    ours = schedule(sampler="dmd", timesteps=timesteps, flow_shift=shift)
    grid = [shift * (k / 1000) / (1 + (shift - 1) * (k / 1000)) for k in range(1, 1001)]
    sig = [min(grid, key=lambda s: abs(1000 * s - t)) for t in timesteps] + [0.0]
    noise = torch.Generator().manual_seed(3)  # the schedule's generator, drawn in the same order
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 4, 4, generator=g)
    want = x.double()
    for i in range(len(timesteps)):
        v = torch.randn(x.shape, generator=g)
        x = ours.step(v, i, x)
        x0 = want - sig[i] * v.double()
        nxt = sig[i + 1]
        want = x0 if nxt == 0 else (1 - nxt) * x0 + nxt * torch.randn(x.shape, generator=noise).double()
        torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)
    assert ours.timesteps.tolist() == [float(t) for t in timesteps]  # the model sees t_i itself


ARRAYS = {  # made per test: a generator is used up once read
    "np-int": lambda: np.array([1000, 757, 522]),
    "np-f32": lambda: np.array([1000.0, 757.0, 522.0], dtype=np.float32),
    "torch-int": lambda: torch.tensor([1000, 757, 522]),
    "torch-f64": lambda: torch.tensor([1000.0, 757.0, 522.0], dtype=torch.float64),
    "generator": lambda: (t for t in (1000, 757, 522)),
}


@pytest.mark.parametrize("form", sorted(ARRAYS))
@pytest.mark.parametrize("sampler", ["euler", "dmd"])
def test_timesteps_as_arrays_and_tensors_equal_the_list(form, sampler):
    s = check_sampling(PRESET, sampler=sampler, timesteps=ARRAYS[form]())
    want = check_sampling(PRESET, sampler=sampler, timesteps=[1000, 757, 522])
    assert s == want and all(type(t) is float for t in s.timesteps)


BAD_FORMS = [
    (torch.tensor(1000.0), "is 0-dimensional"),
    (np.array(1000.0), "is 0-dimensional"),
    (np.float64(1000.0), "is 0-dimensional"),
    (np.array([[1000, 500]]), "is 2-dimensional"),
    (torch.tensor([[1000.0], [500.0]]), "is 2-dimensional"),
    ({1000, 500, 250}, "in order"),  # a set has no order (this one iterates as 1000, 250, 500)
    ({1000: 1, 500: 2}, "in order"),
    (torch.tensor([True, False]), "non-empty list of numbers"),
]


@pytest.mark.parametrize("timesteps,msg", BAD_FORMS)
def test_timesteps_of_the_wrong_form_raise_before_compute(no_compute, timesteps, msg):
    with pytest.raises(InvalidArgumentType, match=msg):
        no_compute.generate_video("a fox", seed=0, save_video=False, sampler="euler", timesteps=timesteps)


def test_timesteps_from_a_generator_are_named_in_the_error(no_compute):
    """The default sampler refuses timesteps; the message shows them even when they came from a generator."""
    with pytest.raises(Exception, match=r"timesteps=\[1000.0, 500.0\] need sampler"):
        no_compute.generate_video("a fox", seed=0, save_video=False, timesteps=(t for t in (1000, 500)))


def test_one_step_euler_and_dmd_both_return_x0(gen):
    """At t = 1000 both rules give x0 = x - v in one step (euler: x + (0 - 1) v; dmd: sigma 1 and no re-noise),
    so their videos are identical; the default sampler runs one step too."""
    kw = dict(seed=4, save_video=False, guidance_scale=1.0, num_inference_steps=1, **SIZE)
    euler = gen.generate_video("a fox", sampler="euler", **kw)
    dmd = gen.generate_video("a fox", sampler="dmd", **kw)
    default = gen.generate_video("a fox", sampler="default", **kw)
    assert euler.num_transformer_forwards == dmd.num_transformer_forwards == default.num_transformer_forwards == 1
    assert np.array_equal(euler.frames, dmd.frames) and euler.frames.std() > 5
