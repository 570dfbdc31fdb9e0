"""qwen_image/vae_frames.py: an image through the VAE as 2D convolutions, without the video chunk cache, gives
diffusers' own encode and decode (float32, within 1e-5 of the largest value), tiled too; videos keep their path."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from train.model.qwen_image import components, pipelines, tiny, vae_frames


def _vaes(full_width: bool = False):
    """(diffusers' own VAE, a deep copy with the 2D path), random weights (every temporal tap non-zero)."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage().eval() if full_width else tiny.build_vae()
    return vae, vae_frames.apply(copy.deepcopy(vae))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _count_conv3d(monkeypatch) -> list:
    """The temporal kernel sizes of the conv3d calls from now on (1x1x1 layers keep theirs: nothing to save)."""
    calls = []
    conv3d = F.conv3d
    monkeypatch.setattr(F, "conv3d", lambda x, w, *a, **k: calls.append(w.shape[2]) or conv3d(x, w, *a, **k))
    return calls


@torch.no_grad()
def _encode_decode(vae, x: torch.Tensor):
    posterior = vae.encode(x).latent_dist
    return posterior.mean, posterior.std, vae.decode(posterior.mean).sample


@pytest.mark.parametrize("case", ["tiny", "tiny_tiled", "released_width"])
def test_an_image_takes_conv2d_and_equals_the_3d_path(case, monkeypatch):
    vae, patched = _vaes(full_width=case == "released_width")
    if case == "tiny_tiled":  # 48x32 in 32-pixel tiles: both tiled_encode and tiled_decode run
        for v in (vae, patched):
            v.enable_tiling(32, 32, 16, 16)
    x = torch.randn(1, 3, 1, 32, 48) if case == "tiny_tiled" else torch.randn(1, 3, 1, 16, 24)
    expected = _encode_decode(vae, x)
    calls = _count_conv3d(monkeypatch)
    actual = _encode_decode(patched, x)
    assert calls and set(calls) == {1}  # every causal 3x3x3 conv of the encoder and decoder ran as conv2d
    for a, e in zip(actual, expected, strict=True):
        _close(a, e)


def test_a_video_keeps_its_chunk_cache_and_equals_the_3d_path(monkeypatch):
    vae, patched = _vaes()
    x = torch.randn(1, 3, 5, 16, 16)  # chunks of 1 and 4 frames; latents of 2 frames
    expected = _encode_decode(vae, x)
    calls = _count_conv3d(monkeypatch)
    actual = _encode_decode(patched, x)
    assert 3 in calls  # the later chunks convolve over their cached frames in 3D
    for a, e in zip(actual, expected, strict=True):
        _close(a, e)


def _cache_held(vae, x: torch.Tensor) -> dict:
    """{'encoder'|'decoder': tensors in the VAE's chunk cache when that module's forward returns}."""
    held = {}
    for name, attr in (("encoder", "_enc_feat_map"), ("decoder", "_feat_map")):
        def record(module, args, out, name=name, attr=attr):
            held[name] = sum(isinstance(t, torch.Tensor) for t in getattr(vae, attr))
        getattr(vae, name).register_forward_hook(record)
    _encode_decode(vae, x)
    return held


def test_an_image_holds_no_chunk_cache_a_video_does():
    vae, patched = _vaes()
    image, video = torch.randn(1, 3, 1, 16, 16), torch.randn(1, 3, 5, 16, 16)
    assert min(_cache_held(vae, image).values()) > 0  # diffusers' path clones each block's input into it
    assert _cache_held(patched, image) == {"encoder": 0, "decoder": 0}
    assert min(_cache_held(patched, video).values()) > 0


def _own_forwards(vae) -> list[str]:
    return [name for name, m in vae.named_modules() for attr in ("forward", "_encode", "_decode")
            if isinstance(m.__dict__.get(attr), types.MethodType)]


def test_the_key_switches_it_and_remove_undoes_it(tmp_path):
    tiny.build_vae().save_pretrained(tmp_path / "vae")
    off = components.load_vae(tmp_path, torch.float32, torch.device("cpu"), vae_2d_frames=False)
    assert _own_forwards(off) == [] and not vae_frames.is_applied(off)
    on = components.load_vae(tmp_path, torch.float32, torch.device("cpu"))  # model.vae_2d_frames' default
    assert vae_frames.is_applied(on) and "encoder.conv_in" in _own_forwards(on)
    assert "quant_conv" not in _own_forwards(on)  # 1x1x1: no zero taps to skip
    assert on.state_dict().keys() == off.state_dict().keys()
    # the strided temporal downsampling conv keeps its own forward: one frame meets more than its last tap there
    assert not any(name.endswith("time_conv") and "down_blocks" in name for name in _own_forwards(on))
    assert _own_forwards(vae_frames.remove(on)) == []


def test_load_pipeline_follows_the_key(tiny_edit):
    assert vae_frames.is_applied(pipelines.load_pipeline(tiny_edit / "model", torch.float32).vae)
    off = pipelines.load_pipeline(tiny_edit / "model", torch.float32, vae_2d_frames=False)
    assert _own_forwards(off.vae) == []
