"""read_image on images of more than 8 bits per sample and on images too large to open: 16-bit greyscale keeps
the high byte (as Pillow itself reads a 16-bit colour PNG), float images in [0, 1] are scaled by 255, and values
outside those ranges, or a decompression bomb, raise InvalidArgument naming the image -- never a clipped picture."""
from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from fastwan.errors import InvalidArgument, UserError
from fastwan.pipelines.image import read_image

# 16-bit samples and their 8-bit values by the high-byte rule, written out by hand
VALUES_16 = np.array([[0, 255, 256, 30000], [30207, 32768, 65280, 65535]], dtype=np.uint16)
HIGH_BYTE = np.array([[0, 0, 1, 117], [117, 128, 255, 255]], dtype=np.uint8)


def png_bytes(width: int, height: int, color_type: int, bit_depth: int, rows: list[bytes]) -> bytes:
    """A PNG file written by hand (no filter, one IDAT), independent of Pillow's encoder."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    raw = b"".join(b"\0" + row for row in rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def rgb(values: np.ndarray) -> np.ndarray:
    """H x W grey values -> H x W x 3."""
    return np.repeat(values[..., None], 3, axis=2)


def test_16bit_grey_png_reads_like_pillows_16bit_colour_png(tmp_path):
    grey = tmp_path / "grey16.png"
    grey.write_bytes(png_bytes(4, 2, 0, 16, [row.astype(">u2").tobytes() for row in VALUES_16]))
    colour = tmp_path / "rgb16.png"
    colour.write_bytes(png_bytes(4, 2, 2, 16, [rgb(row[None])[0].astype(">u2").tobytes() for row in VALUES_16]))
    with Image.open(grey) as img:
        assert img.mode in ("I;16", "I")  # what Pillow opens a 16-bit grey PNG as (version-dependent)
    want = np.asarray(Image.open(colour).convert("RGB"))  # Pillow's own 16-bit -> 8-bit reading
    assert np.array_equal(want, rgb(HIGH_BYTE))
    assert np.array_equal(np.asarray(read_image(grey)), want)
    assert np.array_equal(np.asarray(read_image(str(grey))), want)


@pytest.mark.parametrize("mode,dtype", [("I;16", "<u2"), ("I;16L", "<u2"), ("I;16B", ">u2"), ("I;16N", "=u2"),
                                        ("I", "=i4")])
def test_16bit_modes_keep_the_high_byte(mode, dtype):
    img = Image.frombytes(mode, (4, 2), VALUES_16.astype(dtype).tobytes())
    assert np.array_equal(np.asarray(img), VALUES_16)  # the picture holds the values we think
    out = read_image(img)
    assert out.mode == "RGB" and np.array_equal(np.asarray(out), rgb(HIGH_BYTE))


@pytest.mark.parametrize("bad", [-1, 65536, 2**31 - 1])
def test_int_mode_outside_16_bits_is_refused(bad):
    values = np.array([[0, 100], [bad, 200]], dtype=np.int32)
    with pytest.raises(InvalidArgument, match=rf"last_image: a mode 'I' image .*0\.\.65535.*{bad}"):
        read_image(Image.fromarray(values), name="last_image")


def test_int_mode_with_8_bit_values_is_ambiguous():
    """Image.convert("I") of an 8-bit picture: as 16-bit data it would read black (0..255 >> 8 = 0), so it is
    refused with the two conversions; the same picture as 'L' reads as itself."""
    grey = Image.fromarray(np.array([[0, 90], [200, 255]], dtype=np.uint8))
    with pytest.raises(InvalidArgument, match=r"image: a mode 'I' .*only values 0\.\.255 is ambiguous.*'L'.*'I;16'"):
        read_image(grey.convert("I"))
    assert np.array_equal(np.asarray(read_image(grey.convert("I").convert("L"))), rgb(np.asarray(grey)))


def test_float_mode_is_scaled_by_255(tmp_path):
    values = np.array([[0.0, 0.2, 0.5, 1.0], [0.25, 0.75, 1 / 255, 0.999]], dtype=np.float32)
    want = np.array([[0, 51, 128, 255], [64, 191, 1, 255]], dtype=np.uint8)
    img = Image.fromarray(values)
    assert img.mode == "F"
    assert np.array_equal(np.asarray(read_image(img)), rgb(want))
    path = tmp_path / "float.tiff"
    img.save(path)
    assert np.array_equal(np.asarray(read_image(path)), rgb(want))


@pytest.mark.parametrize("bad,rule", [(1.5, r"\[0, 1\].*0\.\.1\.5"), (-0.25, r"\[0, 1\].*-0\.25\.\.0\.5"),
                                      (np.nan, "NaN or infinity"), (np.inf, "NaN or infinity")])
def test_float_mode_outside_0_1_is_refused(tmp_path, bad, rule):
    img = Image.fromarray(np.array([[0.0, 0.5], [bad, 0.5]], dtype=np.float32))
    with pytest.raises(InvalidArgument, match=rf"image: a float \(mode 'F'\) image .*{rule}"):
        read_image(img)
    path = tmp_path / "bad.tiff"
    img.save(path)
    with pytest.raises(InvalidArgument, match=r"image='.*bad\.tiff': a float"):
        read_image(path)


@pytest.mark.parametrize("dtype,fix", [(np.uint16, r"\(x >> 8\)\.astype\(np\.uint8\)"),
                                       (np.float32, r"values in \[0, 1\]: \(x \* 255\)"),
                                       (np.float64, r"values in \[0, 1\]: \(x \* 255\)"),
                                       (np.int64, r"values in \[0, 255\]")])
def test_arrays_other_than_uint8_are_refused_with_their_conversion(dtype, fix):
    with pytest.raises(InvalidArgument, match=rf"np\.uint8.*got {np.dtype(dtype)} \(4, 4, 3\).*{fix}"):
        read_image(np.zeros((4, 4, 3), dtype=dtype))


def test_decompression_bomb_is_a_user_error(tmp_path):
    bomb = tmp_path / "huge.png"  # the header claims 20000 x 20000; Pillow refuses it on opening
    bomb.write_bytes(png_bytes(20000, 20000, 0, 8, []))
    with pytest.raises(InvalidArgument) as e:
        read_image(bomb)
    msg = str(e.value)
    assert isinstance(e.value, UserError) and e.value.__cause__ is None
    assert "huge.png" in msg and "400,000,000 pixels" in msg and "resize" in msg


def test_decompression_bomb_warning_as_error_is_a_user_error(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("RGB", (30, 20)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)  # 600 pixels: over the limit, under twice it (a warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(InvalidArgument, match=r"big\.png.*600 pixels, over the limit of 400.*resize"):
            read_image(path, name="last_image")
