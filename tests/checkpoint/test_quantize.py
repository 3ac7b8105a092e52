"""FP8 DiT weights through the pipeline and the CLI, fp32 on the CPU: ``quantization="fp8"`` gives the frames of
the checkpoint whose block weights the test rounded to e4m3 itself (tests.models.test_fp8_dit.rounded_copy), for
Wan2.1 and both A14B experts; ``fastwan quantize`` writes a folder that loads in FP8 with the same frames, links the
other components, and never replaces a folder unasked; bad values raise before loading."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.cli import main
from fastwan.errors import InvalidArgument
from fastwan.kernels.fp8 import Fp8Linear
from tests.models.test_fp8_dit import rounded_copy
from tests.pipelines.latents import generate_with_latents

RUN = dict(height=64, width=64, num_frames=9, num_inference_steps=3, guidance_scale=5.0, seed=7, save_video=False)


def generate(model, **load) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 frames as ints, the denoised latents the decoder got)."""
    gen = VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **load)
    res, latents = generate_with_latents(gen, "a red kite over a beach", **RUN)
    return res.frames.astype(int), latents


def frames(model, **load) -> np.ndarray:
    return generate(model, **load)[0]


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-a14b"])
def test_fp8_frames_equal_the_rounded_checkpoints(tiny_ckpts, tmp_path, variant):
    got, got_latents = generate(tiny_ckpts[variant], quantization="fp8")
    want, want_latents = generate(rounded_copy(tiny_ckpts[variant], tmp_path / "rounded"))
    assert np.abs(got - want).max() <= 1
    torch.testing.assert_close(got_latents, want_latents, rtol=1e-4, atol=1e-4)
    # FP8 changes the denoised latents well beyond that tolerance (0.005-0.02 here): the comparison can tell
    assert (generate(tiny_ckpts[variant])[1] - want_latents).abs().max() > 2e-3


def test_cli_quantize_writes_a_folder_that_loads_in_fp8(tiny_ckpts, tmp_path, capsys):
    src, out = tiny_ckpts["wan2.2-a14b"], tmp_path / "fp8"
    assert main(["quantize", "--model", str(src), "--output", str(out), "--device", "cpu"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (out / "text_encoder").is_symlink() and (out / "vae").resolve() == (src / "vae").resolve()
    assert not (out / "transformer").is_symlink() and not (out / "transformer_2").is_symlink()
    gen = VideoGenerator.from_pretrained(out, device="cpu", dtype=torch.float32)
    assert gen.quantization == "fp8" and all(
        any(isinstance(m, Fp8Linear) for m in t.modules()) for t in gen.transformers)
    assert np.array_equal(gen.generate_video("a red kite over a beach", **RUN).frames.astype(int),
                          frames(src, quantization="fp8"))
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["quantize", "--model", str(src), "--output", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: ") and "exists and is not empty" in err and "--overwrite" in err
    assert err.count("\n") == 1 and sorted(p.name for p in out.iterdir()) == before
    assert not list(tmp_path.glob(".fp8.*"))  # no temporary folder left behind


def test_bad_quantization_raises_before_loading(tiny_ckpts, monkeypatch, capsys):
    from fastwan.pipelines import generator

    def boom(*a, **k):
        raise AssertionError("loading started before the checks finished")

    monkeypatch.setattr(generator, "load_transformer", boom)
    with pytest.raises(InvalidArgument, match=r"quantization='int8' is not supported; use None .* or 'fp8'"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", quantization="int8")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--quantization", "int8"])
    assert exc.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
