"""The typed request: one video is the same video whether it comes from the CLI, ``generate_video``,
``gen.generate(GenerationRequest)`` or a request read from JSON; the JSON form round-trips and obeys the published
JSON Schema (checked with the ``jsonschema`` package, an independent validator); the CLI's flags and help come from
the request's fields."""
import json

import imageio.v3 as iio
import jsonschema
import numpy as np
import pytest
import torch

from fastwan import VideoGenerator, cli
from fastwan.cache import SkipSteps, TeaCache
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import from_json, json_schema, options, to_json
from fastwan.options import DiTOptions
from fastwan.pipelines.load_options import LoadOptions
from fastwan.pipelines.params import GenerationRequest

SMALL = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=7)


def _image(seed=0, shape=(40, 56, 3)):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_generation_request_round_trips_through_json_text():
    from PIL import Image

    pil = Image.fromarray(_image(1))
    r = GenerationRequest("a heron", image=pil, last_image=_image(2), negative_prompt="blur", height=64, width=96,
                          num_frames=9, num_inference_steps=np.int64(3), guidance_scale=4,
                          guidance_scale_2=np.float32(3),
                          seed=2**64 - 1, fps=12, output_path="out/clip.mp4", overwrite=True,
                          cache=TeaCache(threshold=0.1, coefficients=(1.0, 2.0)), sampler="euler",
                          timesteps=np.array([1000, 500]), flow_shift=5)
    text = json.dumps(to_json(r))
    back = from_json(GenerationRequest, text)
    for name in ("prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps",
                 "guidance_scale", "guidance_scale_2", "seed", "fps", "overwrite", "cache", "sampler", "timesteps",
                 "flow_shift", "save_video", "return_frames"):
        assert getattr(back, name) == getattr(r, name), name
    assert type(back.num_inference_steps) is int and back.timesteps == (1000.0, 500.0)
    assert str(back.output_path) == "out/clip.mp4"
    assert np.array_equal(np.asarray(back.image), _image(1)) and np.array_equal(np.asarray(back.last_image), _image(2))
    assert to_json(back) == json.loads(text)  # a second trip is the identity


def test_load_options_round_trip_through_json(tmp_path):
    o = LoadOptions("tiny", device="cpu", dtype=torch.float16, vae_dtype=torch.float32, cfg_mode="sequential",
                    dit_options=DiTOptions(block="reference"), cache="skip_steps:steps=2/3", vae_chunk_frames=2,
                    cfg_gate_step=0.5, vae_tiling={"tile_sample_min_height": 64}, attention_config={"sparsity": 0.5})
    back = from_json(LoadOptions, json.dumps(to_json(o)))
    assert back == o and back.cache == SkipSteps((2, 3)) and back.dtype is torch.float16
    assert to_json(back)["dtype"] == "float16" and to_json(back)["dit_options"] == {"block": "reference"}


@pytest.mark.parametrize("cls, good", [(GenerationRequest, GenerationRequest("a fox", seed=3, timesteps=[900, 400],
                                                                             sampler="dmd", cache="none")),
                                       (LoadOptions, LoadOptions("tiny", dtype=torch.bfloat16, cache="teacache"))])
def test_json_form_obeys_the_published_schema(cls, good):
    schema = json_schema(cls)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(to_json(good), schema)
    assert set(schema["properties"]) == {f.name for f, _ in options(cls)}
    assert all(p["description"] for p in schema["properties"].values())
    bad = {**to_json(good), "not_a_field": 1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    with pytest.raises(InvalidArgument, match="'not_a_field' is not a field of " + cls.__name__):
        from_json(cls, bad)


@pytest.mark.parametrize("doc, error, words", [
    ('{"prompt": "x", "seed": -1}', InvalidArgument, "seed=-1"),
    ('{"prompt": "x", "height": "480"}', InvalidArgumentType, "height='480'"),
    ('{"prompt": "x", "guidance_scale": true}', InvalidArgumentType, "guidance_scale=True"),
    ('{"prompt": "x", "num_frame": 9}', InvalidArgument, "did you mean 'num_frames'"),
    ('{"prompt": "x", "seed": 1, "seed": 2}', InvalidArgument, "gives 'seed' twice"),
    ('{"prompt": "x",', InvalidArgument, "not valid JSON"),
    ('["x"]', InvalidArgumentType, "is a JSON object"),
    ('{"seed": 1}', InvalidArgument, "needs 'prompt'"),
    ('{"prompt": "x", "timesteps": [0.9, 0.5]}', InvalidArgument, "look like sigmas"),
    ('{"prompt": "x", "cache": {"type": "tea"}}', InvalidArgument, "'type' must be one of"),
    ('{"prompt": "x", "image": "data:image/png;base64,AAAA"}', InvalidArgument, "not a readable PNG"),
])
def test_bad_json_requests_name_the_value_and_rule(doc, error, words):
    with pytest.raises(error, match=words):
        from_json(GenerationRequest, doc)


def test_the_schema_refuses_what_the_request_refuses():
    """The JSON Schema carries the ranges the request checks (an OpenAPI client sees them too)."""
    schema = json_schema(GenerationRequest)
    for doc in ({"prompt": "x", "seed": -1}, {"prompt": "x", "height": 0}, {"prompt": "x", "fps": 100000},
                {"prompt": "x", "sampler": "ddim"}, {"prompt": "x", "flow_shift": 0}, {"seed": 3}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)
        with pytest.raises((InvalidArgument, InvalidArgumentType)):
            from_json(GenerationRequest, doc)


def test_every_cli_flag_has_help_and_comes_from_a_field():
    parser = cli.Parser(prog="fastwan")
    sub = parser.add_subparsers(dest="command")
    cli._generate_parser(sub)
    gen = sub.choices["generate"]
    flags = {a.option_strings[0]: a for a in gen._actions if a.option_strings and a.option_strings[0] != "-h"}
    assert all(a.help for a in flags.values()), [f for f, a in flags.items() if not a.help]
    for cls in (GenerationRequest, LoadOptions):
        for f, opt in options(cls):
            if opt.flag is not None:
                assert opt.flag in flags and flags[opt.flag].help == opt.help, f.name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "wan2.1", "wan2.1", seed=5)


def test_cli_api_request_and_json_make_the_same_video(tiny, tmp_path, capsys):
    """One request, four ways: the same frames bit for bit (the CLI's through its mp4, which the API writes for the
    same frames the same way). Neither side names a dtype: the device's one default serves both."""
    gen = VideoGenerator.from_pretrained(str(tiny), device="cpu")
    assert gen.dtype == torch.float32
    kw = dict(SMALL, prompt="a lighthouse in fog", guidance_scale=3.0, sampler="euler", flow_shift=3.0)
    a = gen.generate_video(**kw, save_video=False).frames
    b = gen.generate(GenerationRequest(**kw, save_video=False)).frames
    c = gen.generate(from_json(GenerationRequest, json.dumps({**kw, "save_video": False}))).frames
    loaded = VideoGenerator.load(from_json(LoadOptions, json.dumps({"model": str(tiny), "device": "cpu"})))
    d = loaded.generate(GenerationRequest(**kw, save_video=False)).frames
    for other in (b, c, d):
        assert np.array_equal(a, other)
    api_file = gen.generate_video(**kw, output_path=str(tmp_path / "api.mp4"), return_frames=False).video_path
    argv = ["generate", "--model", str(tiny), "--prompt", kw["prompt"], "--height", "32", "--width", "48",
            "--num-frames", "5", "--steps", "2", "--seed", "7", "--guidance-scale", "3", "--sampler", "euler",
            "--flow-shift", "3", "--device", "cpu", "--output", str(tmp_path / "cli.mp4")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "making: 48x32, 5 frames at 8 fps, 2 steps, guidance 3, sampler euler" in out  # before it starts
    assert out.index("making:") < out.index("video:")
    assert np.array_equal(iio.imread(tmp_path / "cli.mp4"), iio.imread(api_file))


def test_a_resolved_request_runs_only_on_its_checkpoint(tiny, tmp_path):
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    gen = VideoGenerator.from_pretrained(str(tiny), device="cpu")
    resolved = gen.resolve(GenerationRequest("a boat", **SMALL, save_video=False))
    assert resolved.settings.height == 32 and resolved.settings.guidance_scale == 5.0  # the preset filled it
    other = VideoGenerator.from_pretrained(str(write_tiny_checkpoint(tmp_path / "w", "wan2.1", seed=9)), device="cpu")
    with pytest.raises(InvalidArgument, match="was resolved for"):
        other.generate(resolved)


def test_cli_errors_name_flags_not_python_arguments(tiny, tmp_path, capsys):
    base = ["generate", "--model", str(tiny), "--prompt", "a kite", "--output", str(tmp_path / "o")]
    for extra, words in ((["--steps", "400"], ["--steps 400", "use at most"]),
                         (["--height", "33"], ["--height 33 is not a multiple of 16"]),
                         (["--seed", "-4"], ["--seed -4 must be >= 0"]),
                         (["--guidance-scale-2", "2"], ["--guidance-scale-2 2.0", "one DiT"])):
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), (extra, err)
        assert "num_inference_steps=" not in err and "guidance_scale_2=" not in err


def test_cli_errors_carry_no_python_spelling(tmp_path, capsys):
    """What a command-line user reads names flags: no ``image=``, ``overwrite=True``, ``lora=[(...)]`` or
    "(CLI --flag)" remark meant for Python callers."""
    existing = tmp_path / "v.mp4"
    existing.write_bytes(b"kept")
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")
    cases = ((["--model", "tiny-wan2.1-i2v"], ["pass --image"]),
             (["--output", str(existing)], ["--overwrite"]),
             (["--lora", f"{lora}:nan"], ["--lora", "finite"]),
             (["--cache", "teacache:threshold=x"], ["--cache"]))
    for extra, words in cases:
        assert cli.main(["generate", "--prompt", "a kite", "--output", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), (extra, err)
        for python in ("image=", "overwrite=", "lora=", "(CLI", "cache="):
            assert python not in err, (extra, err)
    assert existing.read_bytes() == b"kept"


def test_parallel_workers_take_the_request(tiny):
    """A generator of worker processes (num_gpus=2, gloo on the CPU) takes a GenerationRequest as one process
    does, and makes the same video as its own generate_video."""
    kw = dict(SMALL, prompt="a windmill")
    with VideoGenerator.from_pretrained(str(tiny), device="cpu", num_gpus=2) as gen:
        a = gen.generate(GenerationRequest(**kw, save_video=False)).frames
        b = gen.generate_video(**kw, save_video=False).frames
    assert a.shape == (5, 32, 48, 3) and np.array_equal(a, b)


def test_a_fields_rule_error_names_that_field_whatever_its_message_says(monkeypatch):
    """A user error from a field's own rule carries that field (``UserError.field``, which a server reports as the
    error's param), through the request and through check_field; a rule that names another field keeps it."""
    from fastwan import fields
    from fastwan.pipelines.params import check_field

    bad = {"height": -16, "guidance_scale": "high", "seed": -1, "num_inference_steps": 0, "fps": 0}
    for name, value in bad.items():
        with pytest.raises((InvalidArgument, InvalidArgumentType)) as caught:
            GenerationRequest("a heron", **{name: value})
        assert caught.value.field == name
        with pytest.raises((InvalidArgument, InvalidArgumentType)) as caught:
            check_field(name, value)
        assert caught.value.field == name
    rule = {f.name: opt.check for f, opt in options(GenerationRequest)}["seed"]

    def worded(value):  # a message that starts with another field's name
        if value == 5:
            raise InvalidArgument("height=... a reworded rule")
        return rule(value)

    def elsewhere(value):
        if value == 5:
            raise InvalidArgument("a rule about the steps", field="num_inference_steps")
        return rule(value)

    for check, field in ((worded, "seed"), (elsewhere, "num_inference_steps")):
        monkeypatch.setattr(fields, "options", _with_check(fields.options, "seed", check))
        with pytest.raises(InvalidArgument) as caught:
            GenerationRequest("a heron", seed=5)
        assert caught.value.field == field


def _with_check(options_fn, name, check):
    """``options`` with the rule of field ``name`` replaced by ``check``."""
    import dataclasses as dc

    def patched(cls):
        return [(f, dc.replace(opt, check=check) if f.name == name else opt) for f, opt in options_fn(cls)]
    return patched
