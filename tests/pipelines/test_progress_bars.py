"""``set_progress_bar_config(disable=...)``: the denoising and decoding bars on stderr, on by default, off when
disabled (a server's log, a caller with its own progress), on again when re-enabled; the frames are the same."""
from __future__ import annotations

import pytest

from fastwan.errors import InvalidArgumentType

RUN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=1, save_video=False)


def test_bars_follow_the_setting(gen, capsys):
    capsys.readouterr()
    shown = gen.generate_video("a cat", **RUN).frames
    err = capsys.readouterr().err
    assert "denoising" in err and "decoding" in err
    gen.set_progress_bar_config(disable=True)
    try:
        hidden = gen.generate_video("a cat", **RUN).frames
        assert capsys.readouterr().err == ""
    finally:
        gen.set_progress_bar_config(disable=False)
    gen.generate_video("a cat", **RUN)
    assert "denoising" in capsys.readouterr().err
    assert (shown == hidden).all()
    with pytest.raises(InvalidArgumentType, match="True or False"):
        gen.set_progress_bar_config(disable="yes")
