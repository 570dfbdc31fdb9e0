"""train.infer's placement for a budget: every model on the GPU, or the encoders first and the transformer's first
blocks streamed from pinned host memory (the text encoder too where it does not fit whole), or diffusers'
layer-by-layer offload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from train.plan import arch
from train.plan.explain import PlanError
from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.run_plan import gpu_budget, gpu_margin
from train.plan.sizes import GB, count_sizes

# An allowance, not a measurement: a no-grad transformer pass at ~1 MP plus the VAE decode (train.infer's
# placement has not been measured on a GPU).
INFERENCE_ACTIVATION_BYTES = 6 * GB  # one transformer pass and the VAE's decode, up to INFERENCE_TOKENS
INFERENCE_TOKENS = 12_500  # 1 MP with two references: 1.5 GB measured above the models (docs/performance.md)


def inference_allowance(tokens: int) -> float:
    """What train.infer's plan keeps beside the models for a pass and the decode: INFERENCE_ACTIVATION_BYTES up to
    INFERENCE_TOKENS image tokens, in proportion above (both grow with the tokens and the area)."""
    return INFERENCE_ACTIVATION_BYTES * max(1.0, tokens / INFERENCE_TOKENS)


def inference_tokens(most_references: int, area: int) -> int:
    """A bound on a render's image tokens: the target and every reference at `area` pixels, 16 x 16 pixels a token
    (the VAE's 8x and the transformer's 2x2 patches)."""
    return (1 + most_references) * area // 256


@dataclass
class InferencePlacement:
    """train.infer's placement: inference.cpu_offload, and for "blocks" how many of the transformer's first blocks
    keep their matrices in pinned host memory and whether Qwen2.5-VL streams block by block while it encodes."""

    cpu_offload: str
    offload_blocks: int = 0
    stream_text_encoder: bool = False


def inference_placement(
    parts: dict[str, float],
    block_bytes: float,
    num_blocks: int,
    budget: float,
    margin: float,
    streamed_vl: float = 0.0,
    host: Host = UNCOUNTED_HOST,
    tokens: int = 0,
) -> InferencePlacement:
    """train.infer's placement for a budget. parts: bytes of "transformer", "text encoder" and "VAE".

    "none" when every model fits on the GPU at once with inference_allowance(tokens) beside them. Else "blocks": the
    encoders run first for a chunk of rows (the conditioning recorded, as validation replays it) and leave the GPU,
    then the transformer runs with its first blocks streamed from pinned host memory by the project's offloader (two
    device slots), as few as the room allows; Qwen2.5-VL itself streams (`streamed_vl` bytes on the GPU) when it
    does not fit whole. "sequential" (diffusers, layer by layer) when not even that fits. PlanError when the pinned
    host copies (each process its own: the streamed Qwen2.5-VL while encoding, then the streamed blocks) do not fit
    `host`."""
    room = budget - margin - inference_allowance(tokens)
    if sum(parts.values()) <= room:
        return InferencePlacement("none")
    vl, vae = parts["text encoder"], parts["VAE"]
    stream = vl + vae > room
    fixed = parts["transformer"] - num_blocks * block_bytes + vae  # embeddings, norms, output layer; the VAE
    if (stream and streamed_vl + vae > room) or fixed + 2 * block_bytes > room:
        return InferencePlacement("sequential")
    if fixed + num_blocks * block_bytes <= room:
        return InferencePlacement("blocks", 0, stream)
    resident = int((room - fixed - 2 * block_bytes) // block_bytes)
    placed = InferencePlacement("blocks", num_blocks - resident, stream)
    pinned = host.ranks_per_node * max(vl if stream else 0.0, placed.offload_blocks * block_bytes)
    if pinned > host.room_bytes:
        raise PlanError(
            f"train.infer: the models ({sum(parts.values()) / GB:.1f} GB) do not fit the "
            f"{budget / GB:.1f} GB budget, and streaming them ({describe_placement(placed)}) needs "
            f"{pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es)), "
            f"{host.room_bytes / GB:.1f} GB of the {host.available_bytes / GB:.1f} GB available after the "
            "margin. Raise qwen_edit.memory.budget_gb (a larger GPU), start fewer processes per node, or "
            "free host memory"
        )
    return placed


def plan_inference(
    model_dir: str | Path,
    project,
    explicit: set[str],
    device: torch.device,
    host: Host = UNCOUNTED_HOST,
    most_references: int = 1,
) -> tuple[str | None, InferencePlacement]:
    """Set project.inference.cpu_offload from the budget (memory.budget_gb, or the free memory) unless the
    --config sets it or memory.plan is off; returns (the line to print or None, the placement). With
    cpu_offload "blocks" (planned or set) the placement says how many blocks stream. A budget caps the process.
    most_references: the most references a row of the input has (the render's tokens grow with them)."""
    chosen = InferencePlacement(project.inference.cpu_offload)
    if device.type != "cuda":
        return None, chosen
    budget = gpu_budget(project.memory.budget_gb, device)
    margin = gpu_margin(project.memory.margin_gb, budget)
    sizes = count_sizes(model_dir, [], 0)
    parts = {
        "transformer": (sizes.num_blocks * sizes.block_params + sizes.other_params) * 2,
        "text encoder": arch.component_bytes(model_dir, "text_encoder"),
        "VAE": arch.component_bytes(model_dir, "vae"),
    }
    block = sizes.block_params * 2
    streamed = arch.streamed_vl_bytes(model_dir)
    tokens = inference_tokens(most_references, project.inference.area)
    planned = inference_placement(parts, block, sizes.num_blocks, budget, margin, streamed, host, tokens)
    figures = (
        f"memory plan: budget {budget / GB:.1f} GB, models {sum(parts.values()) / GB:.1f} GB (transformer "
        f"{parts['transformer'] / GB:.1f} GB)"
    )
    if project.memory.plan == "off" or "inference.cpu_offload" in explicit:
        if chosen.cpu_offload != "blocks":
            return None, chosen
        # set by the config: as the plan would stream them, none when everything fits, all when nothing would
        chosen = {
            "none": InferencePlacement("blocks", 0, False),
            "sequential": InferencePlacement("blocks", sizes.num_blocks, True),
        }.get(planned.cpu_offload, planned)
        return f'{figures}, inference.cpu_offload "blocks" from --config: {describe_placement(chosen)}', chosen
    project.inference.cpu_offload = planned.cpu_offload
    how = f": {describe_placement(planned)}" if planned.cpu_offload == "blocks" else ""
    return (
        f'{figures} -> inference.cpu_offload = "{planned.cpu_offload}"{how} (set it in --config to choose yourself)'
    ), planned


def describe_placement(placement: InferencePlacement) -> str:
    """The placement in words, "" unless the transformer's blocks stream."""
    if placement.cpu_offload != "blocks":
        return ""
    vl = "Qwen2.5-VL streamed block by block" if placement.stream_text_encoder else "Qwen2.5-VL on the GPU"
    return (
        f"the encoders first for each chunk of rows ({vl}), then the transformer with its first "
        f"{placement.offload_blocks} blocks streamed from pinned host memory"
    )
