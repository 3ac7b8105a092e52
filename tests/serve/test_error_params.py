"""An error's ``param`` names the request field its rule refuses, for the rules that run when the server resolves a
request for its checkpoint (``gen.resolve``: sampling, the video's size, the step cache, CHORDS, image, VACE and
Animate inputs) and for the request's cross-field rules, read from the error's ``field`` and never from its
message. Each request here passes every field's own rule (checked in this process), so the refusal is the
checkpoint's or the combination's; the expected param is the field the rule is about."""
from __future__ import annotations

import openai
import pytest

from tests.serve.helpers import call
from tests.serve.test_animate_uploads import create as create_animate
from tests.serve.test_vace_upload import create as create_vace
from tests.serve.test_vace_upload import mp4, png, refused

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def fields_pass_their_own_rules(body: dict) -> None:
    """``body``'s request fields make a GenerationRequest (each field's rule, and the cross-field rules, pass)."""
    from fastwan.fields import from_json
    from fastwan.pipelines.params import GenerationRequest

    from_json(GenerationRequest, {"prompt": "a cat", **{k: v for k, v in body.items() if k != "size"}})


# (body, the field its rule is about, words of the rule's message); the tiny model: Wan2.1 text-to-video, one
# DiT, a UniPC scheduler of 1000 training timesteps, frame sides multiples of 16, 64 DiT tokens per axis at most
CHECKPOINT_RULES = [
    ({"sampler": "default", "timesteps": [1000, 500]}, "timesteps", "need sampler='euler' or 'dmd'"),
    ({"sampler": "euler", "timesteps": [1000, 500], "num_inference_steps": 3}, "num_inference_steps",
     "disagrees with the 2 timesteps"),
    ({"num_inference_steps": 5000}, "num_inference_steps", "1000 training timesteps"),
    ({"guidance_scale_2": 2.0}, "guidance_scale_2", "one DiT"),
    ({"num_frames": 10}, "num_frames", "is not 4k+1"),
    ({"height": 36, "width": 32}, "height", "not a multiple of 16"),
    ({"height": 32, "width": 16000}, "width", "rope_max_seq_len"),
    ({"size": "32x16000"}, "size", "rope_max_seq_len"),  # the server's own field for height and width
    ({"cache": {"type": "skip_steps", "steps": [7]}, "num_inference_steps": 3}, "cache", "do not exist"),
    ({"cache": {"type": "teacache"}}, "cache", "no published coefficients"),  # its message names no field first
    ({"parallel_sampling": "chords", "chords_cores": 4, "num_inference_steps": 2, "sampler": "euler"},
     "chords_cores", "exceeds the 2 steps"),
    ({"strength": 0.5}, "strength", "without video"),
]


@pytest.mark.parametrize("body, param, words", CHECKPOINT_RULES)
def test_a_checkpoint_rules_error_names_its_field(server, body, param, words):
    fields_pass_their_own_rules(body)
    status, answer = call("POST", f"{server.url}/v1/videos", {"prompt": "a cat", **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["code"] == "invalid_value" and words in error["message"], error


def test_an_image_on_a_text_to_video_model_names_input_reference(server):
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().videos.create(prompt="a cat", size="32x32",
                                      input_reference=("f.png", png(32, 32, 1), "image/png"))
    assert exc.value.body["param"] == "input_reference" and "text-to-video" in exc.value.body["message"]


def test_vace_rules_name_their_field(vace_server):
    """The control video is 9 frames of 48x32; the tiny VACE DiT has two VACE layers."""
    client = vace_server.client()
    cases = [({"height": "64"}, mp4(), "height", "differs from the control video's 32"),
             ({"strength": "0.5"}, mp4(), "strength", "video-to-video's"),
             ({"conditioning_scale": [1.0, 1.0, 1.0]}, mp4(), "conditioning_scale", "a list of 2 numbers"),
             ({"cache": {"type": "skip_steps", "steps": [1]}}, mp4(), "cache", "does not run with VACE")]
    for fields, video, param, words in cases:
        answer = refused(lambda: create_vace(client, video, **fields))  # noqa: B023 -- called at once
        assert answer["status"] == 400 and answer["param"] == param and words in answer["message"], answer


def test_animate_rules_name_their_field(animate_server):
    client = animate_server.client()
    videos = {"pose_video": mp4(9, 32, 48, seed=1), "face_video": mp4(9, 32, 32, seed=2)}
    cases = [({"segment_frames": "5", "overlap": "5"}, "segment_frames", "more than twice overlap=5"),
             ({"num_frames": "13"}, "num_frames", "the driving videos have 9 frames")]
    for fields, param, words in cases:
        answer = refused(lambda: create_animate(client, fields, **videos))  # noqa: B023 -- called at once
        assert answer["status"] == 400 and answer["param"] == param and words in answer["message"], answer


# the tiny causal checkpoint: 3 latent frames per chunk (9, then 12 video frames a chunk), its own steps, no guidance
CAUSAL_RULES = [
    ({"guidance_scale": 3.0}, "guidance_scale", "does not apply to a causal checkpoint"),
    ({"num_inference_steps": 4}, "num_inference_steps", "does not apply to a causal checkpoint"),
    ({"cache": {"type": "skip_steps", "steps": [1]}}, "cache", "does not apply to a causal checkpoint"),
    ({"num_frames": 13}, "num_frames", "latent frames per chunk"),
]


@pytest.mark.parametrize("body, param, words", CAUSAL_RULES)
def test_a_causal_checkpoints_rules_name_their_field(causal_server, body, param, words):
    fields_pass_their_own_rules(body)
    status, answer = call("POST", f"{causal_server.url}/v1/videos", {"prompt": "a cat", "size": "32x32", **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and words in error["message"], error
