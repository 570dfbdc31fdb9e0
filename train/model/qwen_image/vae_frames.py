"""Images through diffusers' AutoencoderKLQwenImage as 2D work (config: model.vae_2d_frames).

The VAE encodes and decodes an image as a video of one frame. Each of its QwenImageCausalConv3d layers pads the
time axis causally (kernel_t - 1 zero frames before the input, when no earlier chunk is cached) and then runs a
kernel_t x 3 x 3 conv3d: with one frame, every temporal tap but the last multiplies zeros. The output is exactly a
conv2d of that frame with the weight's last temporal tap, the spatial zero padding as conv2d's padding: a third of
the FLOPs of the 3x3x3 layers, and no 3-frame padded copy of the input. `apply` gives every such layer a forward
that takes the conv2d when the input has one frame and no cached frames (an image; also a video's first chunk),
and the layer's own forward otherwise (a video's later chunks, which convolve over the frames cached before).

It also runs a single-frame encode or decode without the video chunk cache (`feat_cache`). On the first chunk the
cache holds only None, which takes the same arithmetic as no cache at all (the resampling blocks skip their
temporal convolution on the first chunk either way: "Rep" in the decoder's upsample3d), but every block stores a
clone of its input there until the encode ends (1.5 GB in bf16 for a 1 MP encode at the released width, 2.4 GB for
the decode), and with one frame no later chunk reads them.

The weights are untouched (state_dict, from_pretrained and save_pretrained see the plain model); tiling
(tiled_encode / tiled_decode) and slicing call the same blocks and keep working. Apply before any offloading hook
wraps the layers' forwards (train/model/pipelines.place comes after loading)."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


def apply(vae):
    """Give `vae` (an AutoencoderKLQwenImage) the single-frame 2D path; returns it. Applying twice is harmless."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    if not isinstance(vae, AutoencoderKLQwenImage):
        raise TypeError(f"vae_frames.apply expects diffusers' AutoencoderKLQwenImage, not {type(vae).__name__}")
    for module in vae.modules():
        if isinstance(module, QwenImageCausalConv3d) and _one_tap_on_one_frame(module):
            module.forward = types.MethodType(_conv_forward, module)
    for coder in (vae.encoder, vae.decoder):
        coder.forward = types.MethodType(_coder_forward, coder)
    vae._encode = types.MethodType(_encode, vae)
    vae._decode = types.MethodType(_decode, vae)
    return vae


def remove(vae):
    """Undo `apply`: the VAE's own forwards again (benchmarks time both ways in one process); returns it."""
    for module in vae.modules():
        for name in ("forward", "_encode", "_decode"):
            if isinstance(module.__dict__.get(name), types.MethodType):
                delattr(module, name)
    return vae


def is_applied(vae) -> bool:
    """Whether `apply` gave `vae` the 2D path (and `remove` has not taken it back)."""
    return isinstance(vae.__dict__.get("_encode"), types.MethodType)


def _one_tap_on_one_frame(conv) -> bool:
    """Whether one input frame meets only the kernel's last temporal tap, of several: stride and dilation 1 in
    time, causal padding of kernel_t - 1 zero frames before and none after (diffusers' `_padding` is (w, w, h, h,
    t0, t1)), zeros padding. The (3, 1, 1) stride-2 temporal downsampling conv does not qualify (it only ever sees
    two frames). Nor do the 1x1x1 convolutions (shortcuts, quant_conv): kernel_t 1 multiplies no padding, so
    there is nothing to save, and on a CPU oneDNN's 1x1 conv2d (unlike its conv3d) rounds differently with the
    number of threads, which would make one process's images differ from two processes'."""
    kernel_t = conv.kernel_size[0]
    return (kernel_t > 1 and conv.stride[0] == 1 and conv.dilation[0] == 1 and conv.padding_mode == "zeros"
            and conv._padding[4] == kernel_t - 1 and conv._padding[5] == 0)


def _conv_forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """x_BCTHW: with T == 1 and nothing cached, conv2d on the frame with the last temporal tap; else the layer's
    own forward."""
    if cache_x is not None or x.shape[2] != 1:
        return type(self).forward(self, x, cache_x)
    pad_w, _, pad_h = self._padding[:3]
    out_BCHW = F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, self.stride[1:], (pad_h, pad_w),
                        self.dilation[1:], self.groups)
    return out_BCHW.unsqueeze(2)


def _coder_forward(self, x: torch.Tensor, feat_cache=None, feat_idx=None) -> torch.Tensor:
    """The encoder's or decoder's forward, without the chunk cache while the VAE works on a single-frame input."""
    if getattr(self, "_single_frame_input", False):
        feat_cache = None
    return type(self).forward(self, x, feat_cache, [0] if feat_idx is None else feat_idx)


@contextlib.contextmanager
def _single_frame_input(coder, single: bool):
    # Only _encode/_decode know the whole input's frame count: the first chunk of a video has one frame too, and
    # its later chunks read what that chunk cached.
    coder._single_frame_input = single
    try:
        yield
    finally:
        coder._single_frame_input = False


def _encode(self, x: torch.Tensor):
    with _single_frame_input(self.encoder, x.shape[2] == 1):
        return type(self)._encode(self, x)


def _decode(self, z: torch.Tensor, return_dict: bool = True):
    with _single_frame_input(self.decoder, z.shape[2] == 1):
        return type(self)._decode(self, z, return_dict=return_dict)
