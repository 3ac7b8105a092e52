"""Arguments checked without a checkpoint fail before the checkpoint is resolved (a Hub id is not fetched for a
bad cache or chunk setting); NumPy numbers are numbers; an unusable FASTWAN_CACHE is a user error."""
import numpy as np
import pytest

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, InvalidArgumentType, MissingFileError, UserError
from fastwan.pipelines import generator
from fastwan.checkpoint.presets import PRESETS
from fastwan.pipelines.sampling import check_sampling
from fastwan.checkpoint.tiny import tiny_checkpoint


@pytest.mark.parametrize("kw, error", [
    (dict(cache="deepcache"), InvalidArgument), (dict(vae_chunk_frames=0), (InvalidArgument, InvalidArgumentType)),
    (dict(lora=3), InvalidArgumentType),
])
def test_settings_fail_before_the_checkpoint_is_resolved(monkeypatch, kw, error):
    def resolved(*a, **k):
        raise AssertionError("the checkpoint was resolved before the settings were checked")

    monkeypatch.setattr(generator, "resolve", resolved)
    with pytest.raises(error):
        VideoGenerator.from_pretrained("owner/not-fetched", device="cpu", **kw)


def test_numpy_numbers_are_accepted():
    s = check_sampling(PRESETS["wan2.1"], "euler", [np.float32(1000), np.int64(500)], np.float32(3.0), np.int64(2))
    assert s.num_inference_steps == 2 and type(s.num_inference_steps) is int
    assert s.flow_shift == 3.0 and s.timesteps == (1000.0, 500.0)
    assert check_sampling(PRESETS["wan2.1"], num_inference_steps=np.int32(7)).num_inference_steps == 7


def test_cache_folder_that_is_a_file(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("FASTWAN_CACHE", str(blocker))
    with pytest.raises(MissingFileError, match=r"cannot be written under .*a_file.*FASTWAN_CACHE") as info:
        tiny_checkpoint("wan2.1")
    assert isinstance(info.value, UserError)
