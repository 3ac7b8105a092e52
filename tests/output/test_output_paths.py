"""Where generate_video writes: never over an existing file unless asked, never a partial file, clear errors for a
destination that cannot be written (a NUL in the path, a file name too long for the file system) -- and those
before any compute.

Assertions use builtin exception types (OSError, FileExistsError, ValueError) and the file system itself.
"""
import errno
import os
import shutil
import time
from pathlib import Path

import imageio.v2 as imageio_v2
import imageio.v3 as iio
import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, OutputExistsError, OutputPathError
from fastwan.pipelines import output
from fastwan.pipelines.output import check_output_path, prepare_output, save_video

SMALL = dict(height=64, width=64, num_frames=5, num_inference_steps=2)


@pytest.fixture(scope="module")
def gen_a14b(tiny_ckpts):
    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-a14b"], device="cpu", dtype=torch.float32)


def files(folder: Path) -> list[str]:
    """Every entry of ``folder`` (hidden ones included), sorted."""
    return sorted(p.name for p in folder.iterdir())


def mp4_frames(path) -> int:
    """Frame count of a readable mp4 (raises if it is not one)."""
    return iio.imread(path).shape[0]


def failing_writer(monkeypatch, exc: BaseException, after: int = 2):
    """Make imageio's writer encode ``after`` frames for real, wait until the encoder has started writing its output
    file (its content differs from before, at most 20 s), then raise ``exc``: a failure in the middle of a save."""
    real = imageio_v2.get_writer

    def get_writer(path, *a, **k):
        before = Path(path).read_bytes() if Path(path).is_file() else None
        w = real(path, *a, **k)
        count = [0]
        append = w.append_data

        def append_data(frame, *aa, **kk):
            if count[0] == after:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    now = Path(path).read_bytes() if Path(path).is_file() else None
                    if now is not None and now != before:
                        break
                    time.sleep(0.01)
                raise exc
            count[0] += 1
            return append(frame, *aa, **kk)

        w.append_data = append_data
        return w

    monkeypatch.setattr(imageio_v2, "get_writer", get_writer)


# ---- item 2: a failed or interrupted save changes nothing ------------------------------------------------------
@pytest.mark.parametrize("exc", [RuntimeError("encoder crashed"), KeyboardInterrupt()])
def test_failed_save_leaves_nothing(gen, tmp_path, monkeypatch, exc):
    failing_writer(monkeypatch, exc)
    out = tmp_path / "clip.mp4"
    with pytest.raises(BaseException) as e:
        gen.generate_video("a cat", seed=0, output_path=out, **SMALL)
    assert files(tmp_path) == []  # no partial clip.mp4, no temporary file
    if isinstance(exc, KeyboardInterrupt):
        assert type(e.value) is KeyboardInterrupt  # an interrupt stays an interrupt
    else:
        assert isinstance(e.value, OSError) and str(out) in str(e.value)
        assert e.value.__cause__ is exc


@pytest.mark.parametrize("exc", [RuntimeError("encoder crashed"), KeyboardInterrupt()])
def test_failed_overwrite_keeps_the_old_file(gen, tmp_path, monkeypatch, exc):
    out = tmp_path / "clip.mp4"
    gen.generate_video("a good earlier video", seed=1, output_path=out, **SMALL)
    good = out.read_bytes()
    failing_writer(monkeypatch, exc)
    with pytest.raises(type(exc) if isinstance(exc, KeyboardInterrupt) else OSError):
        gen.generate_video("a cat", seed=0, output_path=out, overwrite=True, **SMALL)
    assert out.read_bytes() == good
    assert files(tmp_path) == ["clip.mp4"]


def test_encoder_that_writes_nothing_is_an_error(gen, tmp_path, monkeypatch):
    class Silent:  # an encoder that "succeeds" without writing a byte
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def append_data(self, frame):
            pass

    monkeypatch.setattr(imageio_v2, "get_writer", lambda *a, **k: Silent())
    out = tmp_path / "clip.mp4"
    with pytest.raises(OSError, match="clip.mp4"):
        gen.generate_video("a cat", seed=0, output_path=out, **SMALL)
    assert files(tmp_path) == []


# ---- item 3: distinct automatic names, no silent overwrite --------------------------------------------------------
LONG = "a photorealistic slow motion shot of a red fox running through fresh snow at dawn"  # > 60 letters


@pytest.mark.parametrize("first,second", [
    (dict(prompt="一只猫在草地上奔跑"), dict(prompt="一只狗在雪地里睡觉")),  # non-ASCII prompts
    (dict(prompt=LONG + ", wide shot"), dict(prompt=LONG + ", close up")),  # equal first 60 letters
    (dict(prompt="a cat", negative_prompt="blurry"), dict(prompt="a cat", negative_prompt="dark")),
    (dict(prompt="a cat", num_inference_steps=3), dict(prompt="a cat", num_inference_steps=2)),
])
def test_different_videos_get_different_files(gen, tmp_path, first, second):
    paths, contents = [], []
    for kw in (first, second):
        res = gen.generate_video(output_path=tmp_path, seed=0, **{**SMALL, **kw})
        paths.append(Path(res.video_path))
        contents.append(paths[-1].read_bytes())
    assert paths[0] != paths[1]
    assert files(tmp_path) == sorted(p.name for p in paths)
    assert all(mp4_frames(p) == 5 for p in paths)
    assert paths[0].read_bytes() == contents[0]  # the second run did not write over the first
    for p in paths:
        assert "_0_" in p.name and p.suffix == ".mp4"  # the seed is in the name


def test_two_models_one_prompt(gen, gen_a14b, tmp_path):
    a = gen.generate_video("a cat", seed=0, output_path=tmp_path, **SMALL)
    a_bytes = Path(a.video_path).read_bytes()
    b = gen_a14b.generate_video("a cat", seed=0, output_path=tmp_path, **SMALL)
    assert a.video_path != b.video_path
    assert Path(a.video_path).read_bytes() == a_bytes
    assert len(files(tmp_path)) == 2


def test_automatic_name_is_readable(gen, tmp_path):
    res = gen.generate_video("A Café on Mars!", seed=42, output_path=tmp_path, **SMALL)
    name = Path(res.video_path).name
    assert name.startswith("a_cafe_on_mars_42_") and name.isascii(), name


@pytest.mark.parametrize("no_hard_links", [False, True])
def test_taken_automatic_name_gets_a_free_one(gen, tmp_path, monkeypatch, no_hard_links):
    if no_hard_links:  # a file system without hard links: the name is still claimed without clobbering
        def link(*a, **k):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", link)
    first = gen.generate_video("a cat", seed=0, output_path=tmp_path, **SMALL)
    first_bytes = Path(first.video_path).read_bytes()
    second = gen.generate_video("a cat", seed=0, output_path=tmp_path, **SMALL)
    assert second.video_path != first.video_path
    assert Path(first.video_path).read_bytes() == first_bytes
    assert files(tmp_path) == sorted([Path(first.video_path).name, Path(second.video_path).name])
    assert mp4_frames(second.video_path) == 5


def test_overwrite_replaces_the_same_automatic_name(gen, tmp_path):
    first = gen.generate_video("a cat", seed=0, output_path=tmp_path, **SMALL)
    second = gen.generate_video("a cat", seed=0, output_path=tmp_path, overwrite=True, **SMALL)
    assert second.video_path == first.video_path
    assert files(tmp_path) == [Path(first.video_path).name]


@pytest.mark.parametrize("name", ["clip.mp4", "CLIP.MP4"])
def test_existing_file_is_refused_before_compute(no_compute, tmp_path, name):
    out = tmp_path / name
    out.write_bytes(b"someone's video")
    with pytest.raises(FileExistsError) as e:
        no_compute.generate_video("a cat", seed=0, output_path=out, **SMALL)
    assert str(out) in str(e.value) and "overwrite" in str(e.value)
    assert out.read_bytes() == b"someone's video"
    assert files(tmp_path) == [name]


def test_overwrite_replaces_an_explicit_file(gen, tmp_path):
    out = tmp_path / "clip.mp4"
    out.write_bytes(b"old")
    res = gen.generate_video("a cat", seed=0, output_path=out, overwrite=True, **SMALL)
    assert res.video_path == str(out) and mp4_frames(out) == 5
    assert files(tmp_path) == ["clip.mp4"]


# ---- item 4: the file-versus-folder rule, "~", and an unwritable destination -------------------------------------
def test_mp4_path_that_is_a_folder_fails_before_compute(no_compute, tmp_path):
    (tmp_path / "clip.mp4").mkdir()
    with pytest.raises(OSError) as e:
        no_compute.generate_video("a cat", seed=0, output_path=tmp_path / "clip.mp4", **SMALL)
    assert str(tmp_path / "clip.mp4") in str(e.value) and "folder" in str(e.value)
    assert files(tmp_path / "clip.mp4") == []


def test_trailing_separator_names_a_folder(gen, tmp_path):
    res = gen.generate_video("a cat", seed=0, output_path=f"{tmp_path / 'clips.mp4'}/", **SMALL)
    assert Path(res.video_path).parent == tmp_path / "clips.mp4"
    assert mp4_frames(res.video_path) == 5


@pytest.mark.parametrize("rest", [("sub",), ("sub", "clip.mp4"), ()])
def test_file_in_the_way_fails_before_compute(no_compute, tmp_path, rest):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"not a folder")
    out = blocker.joinpath(*rest)
    with pytest.raises(OSError) as e:
        no_compute.generate_video("a cat", seed=0, output_path=out, **SMALL)
    assert str(blocker) in str(e.value)
    assert blocker.read_bytes() == b"not a folder"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_folder_fails_before_compute(no_compute, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(OSError, match="not writable"):
            no_compute.generate_video("a cat", seed=0, output_path=folder, **SMALL)
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("name", ["clip.mov", "clip.AVI", "clip.gif", "clip.webm", "clip.mkv", "clip.webp",
                                  "clip.png", "clip.jpg", "clip.JPEG", "clip.bmp", "clip.tif", "clip.TIFF",
                                  "clip.avif", "clip.heic", "clip.HEIF"])
def test_other_video_formats_are_refused_before_compute(no_compute, tmp_path, name):
    with pytest.raises(ValueError) as e:
        no_compute.generate_video("a cat", seed=0, output_path=tmp_path / "out" / name, **SMALL)
    assert name in str(e.value) and "mp4" in str(e.value) and "'/'" in str(e.value)
    assert files(tmp_path) == []  # no folder named after the file


@pytest.mark.parametrize("name", ["clip.mp4", "clip.Mp4", "CLIP.MP4"])
def test_mp4_in_any_case_names_the_file(name):
    target = check_output_path(Path("out") / name, False)
    assert (target.folder, target.explicit) == (Path("out"), Path("out") / name)


def test_tilde_is_the_home_folder(gen, tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    res = gen.generate_video("a cat", seed=0, output_path="~/videos", **SMALL)
    assert Path(res.video_path).parent == home / "videos"
    assert files(cwd) == []  # no literal "~" folder
    assert mp4_frames(res.video_path) == 5


# ---- what changes while the video is computed ---------------------------------------------------------------------
def test_a_folder_removed_during_the_run_is_made_again(tmp_path):
    target = check_output_path(tmp_path / "out" / "deep", False)
    prepare_output(target)
    shutil.rmtree(tmp_path / "out")  # between the check and the save
    path = save_video(target, "v.mp4", np.zeros((5, 16, 16, 3), np.uint8), 8)
    assert path == tmp_path / "out" / "deep" / "v.mp4" and path.stat().st_size > 0


def test_a_file_that_appeared_during_the_run_is_kept_and_so_is_the_video(tmp_path):
    out = tmp_path / "clip.mp4"
    target = check_output_path(out, False)
    prepare_output(target)
    out.write_bytes(b"the user's file")  # appears while the video is computed
    with pytest.raises(OutputExistsError, match=r"appeared while the video was made.* The finished video was kept "
                                                r"as .*clip-unsaved.mp4"):
        save_video(target, "ignored.mp4", np.zeros((5, 16, 16, 3), np.uint8), 8)
    assert out.read_bytes() == b"the user's file"
    assert files(tmp_path) == ["clip-unsaved.mp4", "clip.mp4"] and (tmp_path / "clip-unsaved.mp4").stat().st_size > 0


# ---- paths the file system refuses --------------------------------------------------------------------------------
def test_nul_in_output_path_is_refused_before_compute(no_compute, tmp_path):
    for path in (tmp_path / "a\0b.mp4", f"{tmp_path}/sub\0dir/"):
        with pytest.raises(InvalidArgument, match="NUL"):
            no_compute.generate_video("a cat", seed=0, output_path=path, num_inference_steps=1)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["a" * 300 + ".mp4", "视" * 90 + ".mp4"], ids=["ascii", "cjk"])  # 304, 274 bytes
def test_too_long_file_name_is_a_user_error_before_compute(no_compute, tmp_path, name):
    with pytest.raises(OutputPathError, match="cannot be written") as e:
        no_compute.generate_video("a cat", seed=0, output_path=tmp_path / name, num_inference_steps=1)
    assert str(tmp_path) in str(e.value)
    assert os.listdir(tmp_path) == []
    target = output.check_output_path(tmp_path / ("b" * 251 + ".mp4"), False)  # 255 bytes: allowed
    output.prepare_output(target)
    assert os.listdir(tmp_path) == []
