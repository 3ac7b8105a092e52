"""--lora specs as a user types them: a malformed suffix after an existing file, and an A14B expert suffix
(':high' / ':low') on a one-DiT checkpoint, are one-line user errors (exit 2) naming the value and the fix, before
the model loads; a well-formed expert suffix on an A14B checkpoint reaches the generator. --image / --last-image
from a pipe (bash's <(...)) are read once and make the video; an endless stream is refused."""
import os

import imageio.v3 as iio
import numpy as np
import pytest
from PIL import Image

from fastwan import VideoGenerator, cli
from tests.cli.helpers import assert_one_error_line


class Loaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch):
    """from_pretrained records its lora argument, then stops the run (raises Loaded)."""
    seen = {}

    def fake(model, **kw):
        seen["lora"] = kw["lora"]
        raise Loaded

    monkeypatch.setattr(VideoGenerator, "load", lambda o: fake(o.model, **o.kwargs()))
    return seen


@pytest.fixture
def lora_file(tmp_path):
    path = tmp_path / "style.safetensors"
    path.write_bytes(b"")  # the spec's syntax and the expert rule are checked before the file is read
    return path


def run(tmp_path, *extra) -> int:
    return cli.main(["generate", "--prompt", "a kite", "--output", str(tmp_path / "out"), *extra])


@pytest.mark.parametrize("suffix", [":0.5:mid", ":0.5:", "::0.5", ":high:0.5", ":0.5:low:x"])
def test_malformed_suffix_after_an_existing_file_names_the_suffix(tmp_path, lora_file, loads, capsys, suffix):
    assert run(tmp_path, "--model", "tiny-wan2.2-a14b", "--lora", f"{lora_file}{suffix}") == 2
    assert_one_error_line(capsys.readouterr().err, [f"'{lora_file}' is a file", repr(suffix), "PATH[:SCALE]"],
                          suffix)
    assert "lora" not in loads  # refused before the model loads


@pytest.mark.parametrize("model", ["tiny", "tiny-wan2.2-ti2v"])
@pytest.mark.parametrize("suffix", [":high", ":0.5:low", ":LOW"])
def test_expert_suffix_on_a_one_dit_checkpoint_is_refused(tmp_path, lora_file, loads, capsys, model, suffix):
    spec = f"{lora_file}{suffix}"
    assert run(tmp_path, "--model", model, "--lora", spec) == 2
    expert = suffix.rpartition(":")[2]
    assert_one_error_line(capsys.readouterr().err, [repr(spec), "one DiT", f"drop ':{expert}'"], (model, suffix))
    assert "lora" not in loads


def test_expert_suffix_on_an_a14b_checkpoint_reaches_the_generator(tmp_path, lora_file, loads):
    other = tmp_path / "other.safetensors"  # a file merges into a DiT once: a second file for every-expert
    other.write_bytes(b"")
    with pytest.raises(Loaded):
        run(tmp_path, "--model", "tiny-wan2.2-a14b", "--lora", f"{lora_file}:high", "--lora", f"{lora_file}:0.5:low",
            "--lora", str(other))
    assert loads["lora"] == [(str(lora_file), 1.0, 0), (str(lora_file), 0.5, 1), (str(other), 1.0, None)]


@pytest.mark.parametrize("name", ["style:high", "style:0.5:LOW"])
def test_an_existing_file_named_like_an_expert_suffix_is_the_path(tmp_path, loads, name):
    """A file whose name ends in ':high' / ':low' is itself the LoRA, as a name ending in ':SCALE' is."""
    path = tmp_path / name
    path.write_bytes(b"")
    for spec, scale in ((str(path), 1.0), (f"{path}:0.25", 0.25)):
        with pytest.raises(Loaded):
            run(tmp_path, "--model", "tiny-wan2.2-a14b", "--lora", spec)
        assert loads["lora"] == [(str(path), scale, None)]


def piped(data: bytes) -> str:
    """A pipe holding ``data`` (its write end closed), as a path: what bash's ``<(cat file)`` passes."""
    r, w = os.pipe()
    os.write(w, data)  # under the pipe's buffer size: no reader needed yet
    os.close(w)
    return f"/dev/fd/{r}"


def test_images_from_pipes_make_the_video(tmp_path):
    """--image <(...) / --last-image <(...): a pipe can be read once only; the CLI reads it once and the video is
    made from its pixels."""
    first, last = tmp_path / "first.png", tmp_path / "last.png"
    Image.fromarray(np.full((48, 64, 3), 200, dtype=np.uint8)).save(first)
    Image.fromarray(np.full((48, 64, 3), 20, dtype=np.uint8)).save(last)
    out = tmp_path / "v.mp4"
    args = ["generate", "--prompt", "a kite", "--model", "tiny-wan2.1-flf2v", "--height", "64", "--width", "64",
            "--num-frames", "5", "--steps", "1", "--seed", "0", "--output", str(out)]
    assert cli.main([*args, "--image", piped(first.read_bytes()), "--last-image", piped(last.read_bytes())]) == 0
    assert iio.imread(out).shape == (5, 64, 64, 3)


def test_an_endless_stream_is_refused_as_too_large(monkeypatch, tmp_path, loads, capsys):
    monkeypatch.setattr("fastwan.pipelines.image.MAX_STREAM_BYTES", 1000)
    path = piped(b"\0" * 2000)
    assert run(tmp_path, "--model", "tiny-wan2.1-i2v", "--image", path) == 2
    assert_one_error_line(capsys.readouterr().err, [f"--image {path!r}", "more than", "too large"], path)
    assert "lora" not in loads


@pytest.fixture
def hub_models(tmp_path, monkeypatch):
    """Two tiny checkpoints (one DiT; two experts) in an offline Hub cache, by Hub id."""
    import huggingface_hub.constants as constants

    from fastwan.checkpoint.tiny import write_hub_cache, write_tiny_checkpoint

    cache = tmp_path / "hub"
    for repo, variant in (("tiny-owner/one-dit", "wan2.1"), ("tiny-owner/two-experts", "wan2.2-a14b")):
        write_hub_cache(write_tiny_checkpoint(tmp_path / variant, variant), cache, repo)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import time: set the constants too
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_expert_suffix_on_a_one_dit_hub_model_is_refused(tmp_path, lora_file, loads, capsys, hub_models):
    spec = f"{lora_file}:high"
    capsys.readouterr()  # the checkpoint writer's progress bars
    assert run(tmp_path, "--model", "tiny-owner/one-dit", "--lora", spec) == 2
    assert_one_error_line(capsys.readouterr().err, [repr(spec), "tiny-owner/one-dit", "one DiT", "drop ':high'"],
                          spec)
    assert "lora" not in loads
    with pytest.raises(Loaded):  # the same spec on a two-expert Hub model reaches the generator
        run(tmp_path, "--model", "tiny-owner/two-experts", "--lora", spec)
    assert loads["lora"] == [(str(lora_file), 1.0, 0)]


def test_pickle_lora_needs_allow_pickle(tmp_path, monkeypatch, capsys):
    """A pickle LoRA file is refused (one line naming --allow-pickle) unless --allow-pickle is given, which also
    reaches from_pretrained."""
    import torch

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr(VideoGenerator, "load", lambda o: fake(o.model, **o.kwargs()))
    path = tmp_path / "style.pt"
    torch.save({"blocks.0.attn1.to_q.lora_A.weight": torch.zeros(1, 1)}, path)
    assert run(tmp_path, "--lora", str(path)) == 2
    assert_one_error_line(capsys.readouterr().err, [repr(str(path)), "pickle", "--allow-pickle"], path)
    assert not seen
    with pytest.raises(Loaded):
        run(tmp_path, "--lora", str(path), "--allow-pickle")
    assert seen["allow_pickle"] is True and seen["lora"] == [(str(path), 1.0, None)]
