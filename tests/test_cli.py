"""The CLI makes an mp4 that imageio reads back with the right frame count and size."""
import subprocess
import sys

import pytest

import imageio.v3 as iio


def test_cli_generate_writes_mp4(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTWAN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "clip.mp4"
    r = subprocess.run(
        [sys.executable, "-m", "fastwan.cli", "generate", "--prompt", "a red kite over a beach", "--height", "64",
         "--width", "96", "--num-frames", "9", "--steps", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "FASTWAN_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    assert out.is_file()
    frames = iio.imread(out)
    assert frames.shape == (9, 64, 96, 3)


def test_cli_bad_input_is_a_clean_error(tmp_path):
    out = tmp_path / "x.mp4"
    r = subprocess.run([sys.executable, "-m", "fastwan.cli", "generate", "--prompt", "x", "--num-frames", "8",
                        "--output", str(out)], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "FASTWAN_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2
    assert "num_frames=8" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_cli_vae_tiling_reaches_the_generator(monkeypatch):
    from fastwan import VideoGenerator, cli

    seen = {}

    def fake_from_pretrained(model, **kw):
        seen.update(kw)
        raise ValueError("stop here")  # the CLI turns it into a clean error (exit 2)

    monkeypatch.setattr(VideoGenerator, "from_pretrained", fake_from_pretrained)
    assert cli.main(["generate", "--prompt", "x", "--vae-tiling"]) == 2
    assert seen["vae_tiling"] is True
    assert cli.main(["generate", "--prompt", "x"]) == 2 and seen["vae_tiling"] is False
    assert seen["vae_chunk_frames"] == "auto"
    assert cli.main(["generate", "--prompt", "x", "--vae-chunk-frames", "3"]) == 2 and seen["vae_chunk_frames"] == 3
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "--prompt", "x", "--vae-chunk-frames", bad])
        assert e.value.code == 2
