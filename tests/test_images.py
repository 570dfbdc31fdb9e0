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
from train.model import images, pipelines

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
    fine = pipelines.EditRequest(0, 1, [tmp_path / "phone.jpg"], "edit", 0, "out")
    bad = pipelines.EditRequest(0, 2, [tmp_path / "noise.png"], "edit", 0, "out")
    assert pipelines.check_request(fine, "edit", 32 * 48) is None
    with pytest.raises(images.ImageProblem) as reason:
        images.decoded_size(tmp_path / "noise.png")
    assert pipelines.check_request(bad, "edit") == f"{tmp_path / 'noise.png'}: {reason.value}"
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


def sixteen_bit_rgb_png(path: Path, value: int) -> None:
    """A 4x4 PNG of 16 bits per channel (Pillow cannot write one), every sample = value."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    raw = b"".join(b"\0" + np.full((4, 3), value, dtype=">u2").tobytes() for _ in range(4))
    header = struct.pack(">IIBBBBB", 4, 4, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))


def test_high_bit_depth_scaled_not_clipped(tmp_path):
    """16-bit grey (I;16 PNG), 32-bit grey (I TIFF), float (F TIFF) and 16-bit RGB PNGs become 8 bits scaled."""
    grey = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "deep.png")
    Image.fromarray(grey.astype(np.int32)).save(tmp_path / "int.tif")
    Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)).save(tmp_path / "float.tif")
    sixteen_bit_rgb_png(tmp_path / "rgb48.png", 0xABCD)
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    assert np.asarray(images.open_rgb(tmp_path / "deep.png"))[0, :, 0].tolist() == [0, 100, 255]
    assert np.asarray(images.open_rgb(tmp_path / "int.tif"))[0, :, 0].tolist() == [0, 100, 255]
    assert np.asarray(images.open_rgb(tmp_path / "float.tif"))[0, :, 0].tolist() == [0, 128, 255]
    assert images.open_rgb(tmp_path / "rgb48.png").getpixel((0, 0)) == (0xAB, 0xAB, 0xAB)


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
    request = pipelines.EditRequest(0, 1, [tmp_path / "phone.jpg"], "edit", 0, "out")
    (ref,) = pipelines.open_references(request)
    assert ref.size == (32, 48)


def test_bad_background_message():
    with pytest.raises(ValueError, match=r"qwen_edit.data.alpha_background: 'whiteish' is not a colour"):
        images.background_rgb("whiteish")
