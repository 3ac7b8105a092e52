"""The image side of image-to-video (fastwan.pipelines.image) against diffusers' WanImageToVideoPipeline on the
tiny checkpoint's VAE and a tiny CLIP vision encoder: the condition latents with their frame mask, the CLIP tokens,
and the image reading and default size rules. read_image on inputs a diffusers user hands over: EXIF-rotated
photos read upright (as diffusers' load_image reads them, and as a direct rotation of the pixels gives), and the
default video size follows the upright image; H x W x 1 arrays; URLs, empty paths, folders and os.PathLike paths;
PIL images whose pixels cannot be decoded; and refused arrays and tensors with the conversion that fits them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.image import clip_tokens, condition_latents, default_size, pixels, read_image


def picture(h=40, w=56, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return img.convert(mode)


def test_read_image_accepts_pil_arrays_and_files(tmp_path):
    rgba = picture(mode="RGBA")
    assert read_image(rgba).mode == "RGB"
    grey = np.asarray(picture(mode="L"))
    assert read_image(grey).mode == "RGB" and read_image(grey).size == (56, 40)
    arr = np.asarray(picture())
    assert np.array_equal(np.asarray(read_image(arr)), arr)
    path = tmp_path / "first.png"
    picture().save(path)
    assert np.array_equal(np.asarray(read_image(str(path))), arr)


def test_read_image_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(InvalidArgument, match="no such file"):
        read_image(tmp_path / "missing.png")
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with pytest.raises(InvalidArgument, match="notes.png.*not a readable image"):
        read_image(bad)
    with pytest.raises(InvalidArgument, match="np.uint8"):
        read_image(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(InvalidArgument, match="H x W x 3"):
        read_image(np.zeros((4, 4, 2), dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="0 x 4 pixels; it must not be empty"):
        read_image(np.zeros((4, 0, 3), dtype=np.uint8))
    with pytest.raises(InvalidArgumentType, match="last_image=int"):
        read_image(3, name="last_image")


def test_default_size_keeps_the_aspect_at_the_area():
    # the Wan / diffusers example rule: round(sqrt(area * aspect)) // mod * mod
    assert default_size(picture(720, 1280), 480 * 832, 16) == (464, 832)
    assert default_size(picture(1280, 720), 480 * 832, 16) == (832, 464)
    assert default_size(picture(100, 100), 480 * 832, 16) == (624, 624)
    assert default_size(picture(1, 4000), 480 * 832, 16)[0] == 16  # never below one multiple
    # a derived side past the model's reach (max_side: RoPE range x multiple) names the image, not a given size
    assert default_size(picture(1, 4000), 480 * 832, 16, max_side=40000) == (16, 39968)
    with pytest.raises(InvalidArgument, match=r"image is 4000 x 1 pixels.*side of 39968 pixels, more than this "
                                              r"model's 16384; pass height= and width="):
        default_size(picture(1, 4000), 480 * 832, 16, max_side=16384)
    assert default_size(picture(1, 4000), 480 * 832, 16, 32, 64, max_side=16384) == (32, 64)  # given: as given


@pytest.fixture(scope="module")
def vae(tiny_ckpts):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(tiny_ckpts["wan2.1"] / "vae").eval()


@pytest.mark.parametrize("last", [False, True])
def test_condition_latents_match_diffusers(vae, last):
    from diffusers import WanImageToVideoPipeline

    from fastwan.vae.decode import vae_scale_factors

    ft, fs = vae_scale_factors(vae)
    frames, h, w = 9, 32, 48
    first = pixels(picture(), h, w, fs)
    end = pixels(picture(seed=1), h, w, fs) if last else None
    fake = SimpleNamespace(vae=vae, vae_scale_factor_temporal=ft, vae_scale_factor_spatial=fs,
                           config=SimpleNamespace(expand_timesteps=False))
    noise = torch.zeros(1, vae.config.z_dim, (frames - 1) // ft + 1, h // fs, w // fs)
    with torch.no_grad():
        _, want = WanImageToVideoPipeline.prepare_latents(fake, first, 1, vae.config.z_dim, h, w, frames,
                                                          torch.float32, "cpu", None, noise, end)
    got = condition_latents(vae, first, end, frames)
    assert got.shape == want.shape == (1, ft + vae.config.z_dim, 3, h // fs, w // fs)
    assert torch.equal(got, want)
    assert got[0, :ft, 0].eq(1).all() and got[0, :ft, 1].eq(0).all()
    # the last latent frame's 4 slots are video frames 5..8: only the last one is given, for first-last-frame only
    assert got[0, ft - 1, -1].eq(1 if last else 0).all() and got[0, :ft - 1, -1].eq(0).all()


def test_clip_tokens_match_diffusers():
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                               num_attention_heads=2, image_size=32, patch_size=8)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images = [picture(), picture(seed=1)]
    fake = SimpleNamespace(image_encoder=encoder, image_processor=processor)
    with torch.no_grad():
        want = WanImageToVideoPipeline.encode_image(fake, images, device=torch.device("cpu"))
    got = clip_tokens(encoder, processor, images)
    assert got.shape == (2, 17, 16)  # 16 patches + the class token, penultimate layer
    assert torch.equal(got, want)


# ---- images as users hand them over -------------------------------------------------------------------------------
ORIENTATION = 0x0112  # the EXIF tag
PIXELS = np.random.default_rng(0).integers(0, 256, (3, 5, 3), dtype=np.uint8)
# what each EXIF orientation shows, written out with numpy (the TIFF/EXIF definitions)
UPRIGHT = {1: PIXELS, 2: PIXELS[:, ::-1], 3: PIXELS[::-1, ::-1], 4: PIXELS[::-1],
           5: PIXELS.transpose(1, 0, 2), 6: np.rot90(PIXELS, -1), 7: np.rot90(PIXELS, 2).transpose(1, 0, 2),
           8: np.rot90(PIXELS, 1)}


def tagged(path, array, orientation):
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    Image.fromarray(array).save(path, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("orientation", sorted(UPRIGHT))
def test_exif_orientation_reads_upright_as_diffusers_load_image(tmp_path, orientation):
    from diffusers.utils import load_image

    path = tagged(tmp_path / "photo.png", PIXELS, orientation)
    want = np.asarray(load_image(str(path)))
    assert np.array_equal(want, UPRIGHT[orientation])
    assert np.array_equal(np.asarray(read_image(path)), want)
    with Image.open(path) as opened:
        assert np.array_equal(np.asarray(read_image(opened)), want)  # load_image turns a PIL image alike


def video_size(monkeypatch, **kwargs) -> tuple[int, int]:
    """The (height, width) generate_video settles on for the tiny I2V model and ``kwargs``, stopping before compute."""
    from fastwan import VideoGenerator

    gen = VideoGenerator.from_pretrained("tiny-wan2.1-i2v", device="cpu", dtype=torch.float32)

    class Sized(Exception):
        pass

    def stop(prompt, negative_prompt, s, *rest):
        raise Sized(s.height, s.width)

    monkeypatch.setattr(gen, "_generate", stop)
    with pytest.raises(Sized) as got:
        gen.generate_video("a fox", save_video=False, **kwargs)
    return got.value.args


def test_default_size_follows_the_upright_photo(tmp_path, monkeypatch):
    """A phone photo stored 60 wide x 30 tall, shown rotated (orientation 6): 30 wide x 60 tall, so the default
    video is portrait (the tiny preset's 64 x 64 area at 1:2, each side rounded down to 16)."""
    photo = tagged(tmp_path / "phone.jpg", np.zeros((30, 60, 3), dtype=np.uint8), 6)
    assert video_size(monkeypatch, image=photo) == (80, 32)


@pytest.mark.parametrize("given,expected", [
    ({"height": 96}, (96, 48)),  # a 1:2 (width:height) image: width = 96 / 2
    ({"width": 48}, (96, 48)),
    ({"height": 112}, (112, 48)),  # 56, rounded down to 16
    ({"height": 96, "width": 96}, (96, 96)),  # both given: as given (the image is resized)
])
def test_one_given_side_takes_the_other_from_the_image(monkeypatch, given, expected):
    """A portrait image with only height (or width) given: the other side keeps the image's aspect ratio, rounded
    down to the tiny model's multiple of 16, instead of the preset's value."""
    assert video_size(monkeypatch, image=np.zeros((60, 30, 3), dtype=np.uint8), **given) == expected


def test_h_w_1_array_reads_as_greyscale():
    grey = PIXELS[..., 0]
    want = np.repeat(grey[..., None], 3, axis=2)
    assert np.array_equal(np.asarray(read_image(grey[..., None])), want)
    assert np.array_equal(np.asarray(read_image(grey)), want)


def test_urls_empty_paths_and_folders_are_named(tmp_path):
    with pytest.raises(InvalidArgument, match=r"image='https://example\.com/cat\.png' is a URL.*download"):
        read_image("https://example.com/cat.png")
    with pytest.raises(InvalidArgument, match=r"last_image='' is an empty path"):
        read_image("", name="last_image")
    with pytest.raises(InvalidArgument, match=r"is a folder, not a readable image; give the path"):
        read_image(tmp_path)


def test_any_os_pathlike_is_a_path(tmp_path):
    path = tmp_path / "frame.png"
    Image.fromarray(PIXELS).save(path)

    class Located:
        def __fspath__(self):
            return str(path)

    assert np.array_equal(np.asarray(read_image(Located())), PIXELS)


def test_pil_image_whose_pixels_cannot_be_read_is_a_user_error(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:600])  # the header is whole, the pixel data cut short
    with Image.open(path) as lazy:
        with pytest.raises(InvalidArgument, match=r"last_image: the pixels of this PIL image cannot be read"):
            read_image(lazy, name="last_image")
    Image.fromarray(PIXELS).save(tmp_path / "whole.png")
    with Image.open(tmp_path / "whole.png") as im:
        pass  # closed before its pixels were read
    with pytest.raises(InvalidArgument, match=r"image: the pixels of this PIL image cannot be read"):
        read_image(im)


@pytest.mark.parametrize("array,fix", [
    (np.zeros((3, 4, 5), dtype=np.uint8), r"x\.transpose\(1, 2, 0\)"),
    (np.zeros((1, 4, 5, 3), dtype=np.uint8), r"x\[0\]"),
    (np.zeros((4, 5), dtype=bool), r"x\.astype\(np\.uint8\) \* 255"),
])
def test_refused_arrays_name_the_fix_that_fits(array, fix):
    with pytest.raises(InvalidArgument, match=rf"got {array.dtype} \({', '.join(map(str, array.shape))}\);.*{fix}"):
        read_image(array)


def test_tensor_is_refused_with_its_conversion():
    with pytest.raises(InvalidArgumentType, match=r"image=Tensor: give a PIL image.*t\.permute\(1, 2, 0\)"):
        read_image(torch.zeros(3, 4, 5))


def png_with_exif_chunk(path, payload: bytes):
    """A valid 8 x 8 PNG with an ``eXIf`` chunk holding ``payload`` right after its header chunk."""
    import io
    import struct
    import zlib

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 77, dtype=np.uint8)).save(buf, format="PNG")
    data = buf.getvalue()
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + payload) & 0xFFFFFFFF)
    path.write_bytes(data[:33] + chunk + data[33:])  # 8-byte signature + 25-byte IHDR chunk
    return path


def test_unreadable_exif_is_a_user_error_naming_the_image(tmp_path):
    """Pillow decodes the pixels but raises SyntaxError on metadata that is not a TIFF block: a user error naming
    the file (or the PIL image), not a crash."""
    path = png_with_exif_chunk(tmp_path / "tagged.png", b"garbage-garbage!")
    with pytest.raises(InvalidArgument, match=r"tagged\.png.*EXIF metadata cannot be read"):
        read_image(path, "image")
    with Image.open(path) as img:
        img.load()
        with pytest.raises(InvalidArgument, match=r"last_image: its EXIF metadata cannot be read"):
            read_image(img, "last_image")
    ok = png_with_exif_chunk(tmp_path / "plain.png", Image.Exif().tobytes())  # valid, empty metadata
    assert np.array_equal(np.asarray(read_image(ok)), np.full((8, 8, 3), 77, dtype=np.uint8))


def test_one_frame_with_a_last_frame_is_refused_before_compute(monkeypatch):
    """The condition video of a first-last-frame request is first, zeros, last: one frame leaves no room; the
    request is refused before the text encoder runs."""
    from fastwan import VideoGenerator

    gen = VideoGenerator.from_pretrained("tiny-wan2.1-flf2v", device="cpu", dtype=torch.float32)

    def no_compute(*args, **kwargs):
        raise AssertionError("compute started")

    monkeypatch.setattr(gen, "_generate", no_compute)
    first, last = (np.full((32, 32, 3), v, dtype=np.uint8) for v in (10, 200))
    with pytest.raises(InvalidArgument, match=r"num_frames=1 leaves no frame for last_image="):
        gen.generate_video("a fox", image=first, last_image=last, num_frames=1, save_video=False)
    with pytest.raises(AssertionError, match="compute started"):  # 5 frames pass the checks
        gen.generate_video("a fox", image=first, last_image=last, num_frames=5, save_video=False)


def test_a_too_long_default_side_names_the_image(monkeypatch):
    """A panorama's aspect ratio at the tiny preset's area: a width past the tiny DiT's RoPE range (64 tokens of
    16 pixels); the error names the image and the fix (an explicit size), before compute."""
    with pytest.raises(InvalidArgument, match=r"image is 3000 x 4 pixels.*more than this model's 1024; pass "
                                              r"height= and width="):
        video_size(monkeypatch, image=np.zeros((4, 3000, 3), dtype=np.uint8))
    assert video_size(monkeypatch, image=np.zeros((4, 3000, 3), dtype=np.uint8), height=16, width=1024) == (16, 1024)
