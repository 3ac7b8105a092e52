"""LoRAs by name through ``fastwan serve --lora-dir DIR``: a served video with a LoRA is the video the Python API
makes with that LoRA merged (``from_pretrained(lora=...)``), a video without one after it is the base video, the
same LoRA again after it its LoRA video again; names that reach outside DIR, unknown names, LoRAs that do not fit
the model and malformed items are refused (400) before anything is queued, without the server's paths; a server
without --lora-dir refuses ``lora``; a --lora-dir that is no folder stops the start."""
from __future__ import annotations

import io
import json

import imageio.v3 as iio
import numpy as np
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.lora.helpers import random_lora
from tests.serve.helpers import Server, call, nearest_4k_plus_1, wait

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TINY_FPS = 8
ASK = dict(prompt="a fox in the snow", size="48x32", seconds="0.5")
SETTINGS = dict(num_inference_steps=2, seed=7, negative_prompt="blurry")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the server, its LoRA folder, the tiny generator): style.safetensors and other.safetensors fit the model;
    misfit.safetensors does not; .hidden.safetensors, a/b.safetensors and ../outside.safetensors are valid LoRA
    files no name may reach."""
    from fastwan import VideoGenerator

    tmp = tmp_path_factory.mktemp("serve-lora")
    folder = tmp / "loras"
    (folder / "a").mkdir(parents=True)
    gen = VideoGenerator.from_pretrained("tiny", device="cpu")
    model = gen.transformers[0]
    save_file(random_lora(model, "diffusers", seed=0), str(folder / "style.safetensors"))
    save_file(random_lora(model, "wan", seed=1, alpha=2.0), str(folder / "other.safetensors"))
    for hidden in (folder / ".hidden.safetensors", folder / "a" / "b.safetensors", tmp / "outside.safetensors"):
        save_file(random_lora(model, "diffusers", seed=2), str(hidden))
    rows = model.blocks[0].attn1.to_q.weight.shape[0]
    misfit = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 7),  # 7 inputs: the model has more
              "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(rows, 4)}
    save_file(misfit, str(folder / "misfit.safetensors"))
    srv = Server(tmp, "--lora-dir", str(folder)).start()
    yield srv, folder, gen
    srv.stop()


def served_frames(client, video_id: str) -> np.ndarray:
    done = wait(client, video_id)
    assert done.status == "completed", done.error
    return iio.imread(io.BytesIO(client.videos.download_content(video_id).read()), extension=".mp4")


def local_frames(gen, path) -> np.ndarray:
    """The same request through the Python API, written to ``path`` as the server writes it, read back."""
    gen.generate_video(ASK["prompt"], width=48, height=32, num_frames=nearest_4k_plus_1(0.5 * TINY_FPS),
                       output_path=str(path), **SETTINGS)
    return iio.imread(path)


def test_a_served_lora_video_is_the_python_api_video_with_that_lora(setup, tmp_path):
    from fastwan import VideoGenerator

    srv, folder, gen = setup
    client = srv.client()
    with_lora = client.videos.create(**ASK, extra_body={**SETTINGS, "lora": json.dumps([{"name": "style",
                                                                                          "scale": 0.7}])})
    served_lora = served_frames(client, with_lora.id)
    plain = client.videos.create(**ASK, extra_body=SETTINGS)  # right after: the base weights again
    served_plain = served_frames(client, plain.id)
    status, again = call("POST", f"{srv.url}/v1/videos", {**ASK, **SETTINGS, "lora": [{"name": "style",
                                                                                       "scale": 0.7}]})
    assert status == 200, again
    served_again = served_frames(client, again["id"])

    base = local_frames(gen, tmp_path / "base.mp4")
    merged = VideoGenerator.from_pretrained("tiny", device="cpu", lora=[(str(folder / "style.safetensors"), 0.7)])
    reference = local_frames(merged, tmp_path / "lora.mp4")
    assert np.array_equal(served_lora, reference)
    assert np.abs(reference.astype(int) - base.astype(int)).max() > 10  # the LoRA changes the video
    assert np.array_equal(served_plain, base)
    assert np.array_equal(served_again, reference)


def test_two_loras_and_the_plain_name_form(setup, tmp_path):
    """``lora`` as a list of a plain name and an item, through a JSON body: both merged, in order."""
    from fastwan import VideoGenerator

    srv, folder, _ = setup
    client = srv.client()
    status, created = call("POST", f"{srv.url}/v1/videos", {**ASK, **SETTINGS,
                                                            "lora": ["other", {"name": "style", "scale": -0.5}]})
    assert status == 200, created
    served = served_frames(client, created["id"])
    merged = VideoGenerator.from_pretrained("tiny", device="cpu", lora=[(str(folder / "other.safetensors"), 1.0),
                                                                         (str(folder / "style.safetensors"), -0.5)])
    assert np.array_equal(served, local_frames(merged, tmp_path / "two.mp4"))


@pytest.mark.parametrize("lora, says, code", [
    ("../outside", "lora name '../outside' is refused", "invalid_value"),
    (["a/b"], "lora name 'a/b' is refused", "invalid_value"),
    ([{"name": ".hidden"}], "lora name '.hidden' is refused", "invalid_value"),
    ([{"name": "a\\b"}], "is refused", "invalid_value"),
    (["sty le"], "lora name 'sty le' is refused", "invalid_value"),
    (["x" * 129], "1-128 letters", "invalid_value"),
    (["unknown"], "lora name 'unknown': this server has no LoRA of that name; its LoRAs are: misfit, other, style",
     "lora_not_found"),
    (["style.safetensors"], "(leave out '.safetensors')", "lora_not_found"),
    (["misfit"], "LoRA 'misfit': transformer.blocks.0.attn1.to_q.lora_A.weight (4, 7)", "invalid_value"),
    ([{"name": "style", "expert": 1}], "this checkpoint has 1 expert(s)", "invalid_value"),
    ([{"name": "style", "expert": True}], "expert=True must be 0", "invalid_value"),
    ([{"name": "style", "scale": "0.5"}], "scale='0.5' must be a finite number", "invalid_value"),
    ([{"name": "style", "strength": 1}], "'strength' is not a key of a LoRA item", "unknown_parameter"),
    ([{"scale": 1}], "has no name", "missing_required_parameter"),
    (["style", "style"], "is given twice", "invalid_value"),
    ([7], "lora item 7 must be a name", "invalid_type"),
    ({"name": "style", "x": 1}, "'x' is not a key", "unknown_parameter"),
    ("[not json", "is not valid JSON", "invalid_value"),
    (["style"] * 9, "lora lists 9 LoRAs; a request takes 8 at most", "invalid_value"),
])
def test_bad_lora_items_are_refused_before_queueing(setup, lora, says, code):
    srv, folder, _ = setup
    client = srv.client()
    before = [v.id for v in client.videos.list(limit=100).data]
    status, body = call("POST", f"{srv.url}/v1/videos", {**ASK, **SETTINGS, "lora": lora})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "lora" and error["code"] == code and says in error["message"], error
    assert str(folder.parent) not in error["message"]  # never the server's paths
    assert [v.id for v in client.videos.list(limit=100).data] == before


def test_a_lora_that_fails_to_merge_fails_its_job_and_leaves_the_base_weights(setup, tmp_path):
    """A scale whose merged weights overflow is known only when they merge: that job fails saying so (naming the
    LoRA, not its path), the LoRA merged before it in the list is undone, and the next job is the base video."""
    srv, folder, gen = setup
    client = srv.client()
    status, created = call("POST", f"{srv.url}/v1/videos", {**ASK, **SETTINGS,
                                                            "lora": ["other", {"name": "style", "scale": 1e300}]})
    assert status == 200, created
    failed = wait(client, created["id"])
    assert failed.status == "failed" and failed.error.code == "invalid_request"
    assert "LoRA 'style': with scale=1e+300" in failed.error.message and str(folder) not in failed.error.message
    plain = client.videos.create(**ASK, extra_body=SETTINGS)
    assert np.array_equal(served_frames(client, plain.id), local_frames(gen, tmp_path / "base.mp4"))


def test_the_server_keeps_serving_after_refusals_and_the_form_spellings(setup):
    srv, _, _ = setup
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as exc:  # the client's own spelling of a list of objects
        client.videos.create(**ASK, extra_body={**SETTINGS, "lora": [{"name": "style", "scale": 0.5}]})
    assert exc.value.body["param"] == "lora" and "json.dumps" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.videos.create(**ASK, extra_body={**SETTINGS, "lora": ["../outside"]})
    assert "'../outside' is refused" in exc.value.body["message"]
    video = client.videos.create(**ASK, extra_body={**SETTINGS, "lora": ["style", "other"]})  # lora[] items
    assert wait(client, video.id).status == "completed"


def test_null_or_an_empty_list_is_no_lora(setup):
    srv, _, _ = setup
    client = srv.client()
    for lora in (None, []):
        status, created = call("POST", f"{srv.url}/v1/videos", {**ASK, **SETTINGS, "lora": lora})
        assert status == 200, created
        assert wait(client, created["id"]).status == "completed"


def test_a_server_without_lora_dir_refuses_lora(server):
    status, body = call("POST", f"{server.url}/v1/videos", {**ASK, "lora": ["style"]})
    assert status == 400 and body["error"]["param"] == "lora"
    assert body["error"]["code"] == "unsupported_parameter" and "--lora-dir" in body["error"]["message"]


@pytest.mark.parametrize("make, says", [(lambda p: None, "no such folder"),
                                        (lambda p: p.write_text("x"), "not a folder")])
def test_a_lora_dir_that_is_no_folder_stops_the_start(tmp_path, monkeypatch, capsys, make, says):
    from fastwan import cli

    monkeypatch.chdir(tmp_path)
    make(tmp_path / "loras")
    assert cli.main(["serve", "--data-dir", str(tmp_path / "d"), "--lora-dir", str(tmp_path / "loras")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastwan: error: --lora-dir ") and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "d").exists()
