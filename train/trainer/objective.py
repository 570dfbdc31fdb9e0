"""Rectified-flow objective as pure tensor functions.

x_t = (1 - s) x0 + s e, the transformer predicts the velocity e - x0, and the loss is the MSE on the
target's tokens only (the clean reference tokens appended after them carry no loss). The timestep the
transformer takes is s itself (the pipelines pass scheduler_t / 1000 = sigma).

Default density, "shifted": s = shift * u / (1 + (shift - 1) * u) with u ~ U(0, 1) and shift = exp(mu), mu
computed from the number of target tokens with the scheduler's own dynamic-shift rule. This is the map the
scheduler applies to its evenly spaced inference sigmas (shift about 2.0 at 1024^2 with the released
scheduler config), so training sees noise levels in the proportions that sampling visits them.
"""

from __future__ import annotations

import math

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift

DENSITIES = ("shifted", "uniform", "logit_normal")
WEIGHTINGS = ("none", "cosmap")


def dynamic_shift(num_target_tokens: int, scheduler_config) -> float:
    """exp(mu) that the pipeline's scheduler uses for an image of `num_target_tokens` packed tokens."""
    mu = calculate_shift(
        num_target_tokens,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )
    return math.exp(mu)


def sample_sigmas(
    batch_size: int,
    density: str,
    generator: torch.Generator,
    shift: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """Noise levels s in (0, 1), shape (B,), float32 on the generator's device."""
    device = generator.device
    if density == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * torch.randn(batch_size, generator=generator, device=device))
    u = torch.rand(batch_size, generator=generator, device=device)
    if density == "uniform":
        return u
    if density == "shifted":
        return shift * u / (1 + (shift - 1) * u)
    raise ValueError(f"unknown timestep density {density!r}; choose one of {DENSITIES}")


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas_B: torch.Tensor) -> torch.Tensor:
    s = sigmas_B.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def loss_weights(sigmas_B: torch.Tensor, weighting: str) -> torch.Tensor:
    if weighting == "none":
        return torch.ones_like(sigmas_B)
    if weighting == "cosmap":  # SD3's cosine-map weighting; emphasises the middle of the trajectory
        return 2 / (math.pi * (1 - 2 * sigmas_B + 2 * sigmas_B**2))
    raise ValueError(f"unknown loss weighting {weighting!r}; choose one of {WEIGHTINGS}")


def flow_loss(pred_BLC: torch.Tensor, target_BLC: torch.Tensor, weights_B: torch.Tensor) -> torch.Tensor:
    """Weighted MSE in float32 over the target tokens; `pred` may hold reference tokens after them."""
    pred = pred_BLC[:, : target_BLC.shape[1]].float()
    per_sample = ((pred - target_BLC.float()) ** 2).mean(dim=(1, 2))
    return (weights_B.float() * per_sample).mean()
