"""Images reach the model as a viewer shows them (train/model/images.py), in every reader: EXIF orientation, alpha over
the configured background, 16-bit scaled to 8 bits; the training dataset, pre-flight and inference agree."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from train.data.pairs import EditDataset, preflight
from train.data.rows import BadRowsError
from train.model import images, renders

RED, BLUE = (255, 0, 0), (0, 0, 255)


def rotated_jpeg(path: Path, orientation: int = 6, format: str | None = None) -> None:
    """A 48x32 stored image (JPEG unless `format` says otherwise), red on top and blue below, tagged so that viewers
    turn it: orientation 6 turns it 90 degrees clockwise (shown 32x48, red on the right, blue on the left)."""
    im = Image.new("RGB", (48, 32), RED)
    im.paste(BLUE, (0, 16, 48, 32))
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.save(path, format, quality=95, exif=exif.tobytes())


# EXIF orientation -> (shown size, (x, y) of a red and of a blue pixel as shown)
SHOWN = {6: ((32, 48), (28, 24), (3, 24)),  # 90 degrees clockwise: the top goes right
         8: ((32, 48), (3, 24), (28, 24)),  # 90 degrees counter-clockwise: the top goes left
         3: ((48, 32), (24, 28), (24, 3))}  # 180 degrees: the top goes to the bottom


@pytest.mark.parametrize("orientation", SHOWN)
@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp"])
def test_exif_orientation_applied_and_sizes_read_as_shown(tmp_path, suffix, orientation):
    """JPEG, PNG (eXIf chunk) and WebP carrying an EXIF Orientation tag are opened as shown, and the header-only
    size readers (bucketing, pre-flight, rendering checks) agree with what is decoded."""
    path = tmp_path / f"phone{suffix}"
    rotated_jpeg(path, orientation)
    size, red, blue = SHOWN[orientation]
    shown = images.open_rgb(path)
    assert shown.size == size
    pixels = np.asarray(shown).astype(int)
    assert np.abs(pixels[red[1], red[0]] - RED).max() < 40 and np.abs(pixels[blue[1], blue[0]] - BLUE).max() < 40
    with Image.open(path) as im:
        assert im.size == (48, 32) and images.oriented_size(im) == size
    assert images.shown_size(path) == images.decoded_size(path) == size


def test_every_reader_opens_user_images_through_one_opener():
    """No module but train/model/images.py opens an image file (so none can skip its orientation, alpha or depth
    handling); validation only reopens the PNGs it rendered itself."""
    own_renders = {Path("train/trainer/validation.py")}
    root = Path(__file__).resolve().parents[1]
    openers = {path.relative_to(root) for path in (root / "train").rglob("*.py") if "Image.open(" in path.read_text()}
    assert openers - own_renders == {Path("train/model/images.py")}


def test_rendering_checks_decode_as_the_readers_do(tmp_path):
    """train.infer's and validation's request check reads references through the same decoder as pre-flight: a
    rotated phone JPEG passes, a corrupt file gets the pre-flight's reason."""
    rotated_jpeg(tmp_path / "phone.jpg")
    (tmp_path / "noise.png").write_bytes(b"not an image" * 40)
    fine = renders.EditRequest(0, 1, [tmp_path / "phone.jpg"], "edit", 0, "out")
    bad = renders.EditRequest(0, 2, [tmp_path / "noise.png"], "edit", 0, "out")
    assert renders.check_request(fine, "edit", 32 * 48) is None
    with pytest.raises(images.ImageProblem) as reason:
        images.decoded_size(tmp_path / "noise.png")
    assert renders.check_request(bad, "edit") == f"{tmp_path / 'noise.png'}: {reason.value}"
    assert "cannot be decoded (UnidentifiedImageError" in str(reason.value) and "re-save it as PNG/JPEG" in str(
        reason.value)


def test_alpha_composited_over_background():
    """Fully transparent pixels take the background, half-transparent ones blend; the default is white."""
    im = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    im.putpixel((1, 0), (255, 0, 0, 128))
    assert np.asarray(images.to_rgb(im)).tolist() == [[[255, 255, 255], [255, 127, 127]]]
    assert np.asarray(images.to_rgb(im, "black")).tolist() == [[[0, 0, 0], [128, 0, 0]]]
    grey_alpha = Image.new("LA", (1, 1), (0, 0))
    assert images.to_rgb(grey_alpha, "#00ff00").getpixel((0, 0)) == (0, 255, 0)
    palette = Image.new("P", (1, 1), 0)
    palette.info["transparency"] = 0
    assert images.to_rgb(palette).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("suffix, mode, key, other", [
    (".png", "RGB", (10, 20, 30), (1, 2, 3)), (".png", "L", 10, 200), (".png", "I;16", 257 * 10, 65535),
    (".gif", "P", 0, 1)])
def test_single_transparent_colour_composited(tmp_path, suffix, mode, key, other):
    """A PNG whose tRNS chunk names one transparent grey or RGB value (8- or 16-bit), and a GIF's transparent
    palette index, show the background there; the other pixel keeps its colour."""
    im = Image.new(mode, (2, 1), key)
    if mode == "P":
        im.putpalette([10, 20, 30, 1, 2, 3])
    im.putpixel((1, 0), other)
    im.save(tmp_path / f"keyed{suffix}", transparency=key)
    shown = images.open_rgb(tmp_path / f"keyed{suffix}", "#00ff00")
    assert shown.getpixel((0, 0)) == (0, 255, 0)
    assert shown.getpixel((1, 0)) == {"RGB": (1, 2, 3), "L": (200,) * 3, "I;16": (255,) * 3, "P": (1, 2, 3)}[mode]


PNG_SAMPLES = {0: 1, 2: 3, 4: 2, 6: 4}  # PNG colour type (grey, RGB, grey + alpha, RGBA) -> samples per pixel


def sixteen_bit_png(path: Path, value: int, color_type: int = 2) -> None:
    """A 4x4 PNG of 16 bits per sample (Pillow cannot write one), every sample = value."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = np.full((4, PNG_SAMPLES[color_type]), value, dtype=">u2").tobytes()
    header = struct.pack(">IIBBBBB", 4, 4, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(b"".join(b"\0" + row for _ in range(4)))) + chunk(b"IEND", b""))


def tiff(path: Path, array: np.ndarray, sample_format: int = 1) -> None:
    """An uncompressed little-endian TIFF of a (2, 3, samples) array (16-bit RGB/RGBA or float RGB, which Pillow
    cannot write); sample_format 1 = unsigned integers, 3 = floats."""
    height, width, samples = array.shape
    pixels = array.astype(array.dtype.newbyteorder("<")).tobytes()
    bits = struct.pack(f"<{samples}H", *[array.dtype.itemsize * 8] * samples)
    formats = struct.pack(f"<{samples}H", *[sample_format] * samples)
    bits_at, formats_at = 8 + len(pixels), 8 + len(pixels) + len(bits)
    tags = [(256, 3, 1, width), (257, 3, 1, height), (258, 3, samples, bits_at), (259, 3, 1, 1),
            (262, 3, 1, 2), (273, 4, 1, 8), (277, 3, 1, samples), (278, 3, 1, height), (279, 4, 1, len(pixels)),
            *([(338, 3, 1, 2)] if samples == 4 else []), (339, 3, samples, formats_at)]  # 338: unassociated alpha
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", *t) for t in tags) + struct.pack("<I", 0)
    path.write_bytes(b"II*\0" + struct.pack("<I", formats_at + len(formats)) + pixels + bits + formats + ifd)


def test_high_bit_depth_scaled_not_clipped(tmp_path):
    """16-bit grey (I;16 PNG, big-endian I;16B TIFF), 32-bit grey (I TIFF, of 16- or 32-bit values), float (F TIFF),
    16-bit RGB PNGs and TIFFs become 8 bits scaled (16-bit RGB keeps its high byte, as Pillow decodes it)."""
    grey = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "deep.png")
    Image.fromarray(grey.astype(">u2")).save(tmp_path / "big_endian.tif")
    Image.fromarray(grey.astype(np.int32)).save(tmp_path / "int.tif")
    Image.fromarray(np.array([[0, 2**30, 2**31 - 1]], dtype=np.int32)).save(tmp_path / "int32.tif")
    Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)).save(tmp_path / "float.tif")
    sixteen_bit_png(tmp_path / "rgb48.png", 0xABCD)
    tiff(tmp_path / "rgb48.tif", np.full((2, 3, 3), 0xABCD, dtype=np.uint16))
    assert [Image.open(tmp_path / name).mode for name in ("deep.png", "big_endian.tif", "int32.tif")] == [
        "I;16", "I;16B", "I"]
    for name in ("deep.png", "big_endian.tif", "int.tif"):
        assert np.asarray(images.open_rgb(tmp_path / name))[0, :, 0].tolist() == [0, 100, 255], name
    assert np.asarray(images.open_rgb(tmp_path / "int32.tif"))[0, :, 0].tolist() == [0, 128, 255]
    assert np.asarray(images.open_rgb(tmp_path / "float.tif"))[0, :, 0].tolist() == [0, 128, 255]
    assert images.open_rgb(tmp_path / "rgb48.png").getpixel((0, 0)) == (0xAB, 0xAB, 0xAB)
    assert images.open_rgb(tmp_path / "rgb48.tif").getpixel((0, 0)) == (0xAB, 0xAB, 0xAB)


@pytest.mark.parametrize("color_type", [4, 6])
def test_sixteen_bit_alpha_composited(tmp_path, color_type):
    """16-bit grey + alpha and RGBA PNGs (and a 16-bit RGBA TIFF): 0xABCD grey at alpha 0xABCD over black is
    0xAB * 0xAB / 255 (about 115), over white that plus the rest of white (about 199)."""
    sixteen_bit_png(tmp_path / "alpha.png", 0xABCD, color_type)
    tiff(tmp_path / "rgba64.tif", np.full((2, 3, 4), 0xABCD, dtype=np.uint16))
    for path in (tmp_path / "alpha.png", tmp_path / "rgba64.tif"):
        over_black = images.open_rgb(path, "black").getpixel((0, 0))
        over_white = images.open_rgb(path).getpixel((0, 0))
        assert all(abs(v - 0xAB * 0xAB / 255) <= 1 for v in over_black), (path, over_black)
        assert all(abs(v - (0xAB * 0xAB / 255 + 255 - 0xAB)) <= 1 for v in over_white), (path, over_white)


def test_undecodable_depth_refused_naming_row_and_file(tmp_path):
    """A float RGB TIFF, which Pillow cannot decode, stops the pre-flight with the row, the file and the fix."""
    tiff(tmp_path / "hdr.tif", np.full((2, 3, 3), 0.5, dtype=np.float32), sample_format=3)
    Image.new("RGB", (3, 2)).save(tmp_path / "ok.png")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"image": "ok.png", "edit_image": "hdr.tif", "prompt": "p"}))
    with pytest.raises(BadRowsError, match=r"row 1 \(hdr.tif\): cannot be decoded \(UnidentifiedImageError.*re-save "
                                           r"it as PNG/JPEG \(8 or 16 bits per channel\) or remove the row"):
        preflight(tmp_path, "edit", "stop")


def test_dataset_and_preflight_see_the_shown_image(tmp_path):
    """A rotated phone JPEG trains upright (the bucket sizes are the shown ones); a 16-bit grey PNG and an RGBA
    PNG pass pre-flight and train scaled and composited over data.alpha_background."""
    rotated_jpeg(tmp_path / "phone.jpg")
    Image.fromarray(np.full((32, 48), 65535, dtype=np.uint16)).save(tmp_path / "deep.png")
    Image.new("RGBA", (48, 32), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    rows = [{"image": "phone.jpg", "edit_image": "phone.jpg", "prompt": "upright"},
            {"image": "deep.png", "edit_image": "clear.png", "prompt": "deep"}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    good = preflight(tmp_path, "edit", "stop")
    assert [r.sizes for r in good] == [[(32, 48), (32, 48)], [(48, 32), (48, 32)]]
    area = 32 * 48
    dataset = EditDataset(tmp_path, good, "edit", area, area, background="black")
    upright, deep = dataset[0], dataset[1]
    assert upright["target"].shape[1] > upright["target"].shape[2]  # taller than wide, as shown
    red_channel = upright["target"][0]
    assert red_channel[:, -4:].mean() > 0.5 and red_channel[:, :4].mean() < -0.5  # red on the right
    assert deep["target"].min() > 0.99  # 65535 -> white, not clipped noise
    assert deep["reference_pixels"][0].max() < -0.99  # transparent over black


def test_inference_references_oriented(tmp_path):
    """train.infer and validation open references the same way as the training data."""
    rotated_jpeg(tmp_path / "phone.jpg")
    request = renders.EditRequest(0, 1, [tmp_path / "phone.jpg"], "edit", 0, "out")
    (ref,) = renders.open_references(request)
    assert ref.size == (32, 48)


def test_bad_background_message():
    with pytest.raises(ValueError, match=r"qwen_edit.data.alpha_background: 'whiteish' is not a colour"):
        images.background_rgb("whiteish")
