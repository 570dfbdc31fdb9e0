"""The cache build's decision: whether the text encoder fits the GPU beside the VAE and the largest encode, or
streams its blocks from pinned host memory (loading.stream_from_host), or cannot be built within the budget."""

from __future__ import annotations

import torch

from train.plan import arch
from train.plan.explain import PlanError
from train.plan.host import Host, node_host
from train.plan.measure import encode_transient
from train.plan.run_plan import gpu_budget, gpu_margin
from train.plan.sizes import GB
from train.plan.workload import Workload


def stream_vl_for_cache(cfg, d, bucket_keys) -> bool:
    """Whether the cache build streams the VL encoder's blocks from pinned host memory (loading.stream_from_host:
    two device slots per block list, the next block prefetched) instead of holding it on the GPU: see
    cache_vl_decision. Measures the VAE's largest encode; prints a streamed decision. Never on a CPU, nor with
    memory.plan "off" (the config as written)."""
    from train.runtime.console import print0

    project = cfg.project
    if d.device.type != "cuda" or project.memory.plan == "off":
        return False
    budget = gpu_budget(project.memory.budget_gb, d.device)
    room = budget - gpu_margin(project.memory.margin_gb, budget) - torch.cuda.memory_allocated(d.device)
    largest = max((hw for key in bucket_keys for hw in key), key=lambda hw: hw[0] * hw[1])  # target or reference
    model_dir = project.model.path
    need = {
        "vl": arch.component_bytes(model_dir, "text_encoder"),
        "vae": arch.component_bytes(model_dir, "vae"),
        "encode": encode_transient(model_dir, d.device, Workload(1, 0, largest, 0), project.model.vae_2d_frames),
    }
    host = node_host(cfg.world_size)  # a collective: every rank takes part, whatever its own decision
    if need["vl"] + need["vae"] + need["encode"] <= room:
        return False
    need["streamed"] = arch.streamed_vl_bytes(model_dir)
    line = cache_vl_decision(need, room, budget, host)
    print0(line, rank=d.rank)
    return True


def cache_vl_decision(need: dict[str, float], room: float, budget: float, host: Host) -> str:
    """The cache build's line when the VL encoder (need["vl"]) + the VAE + the largest encode do not fit `room` (the
    budget less the margin): streamed, it holds need["streamed"] on the GPU and each process pins its copy in host
    memory. PlanError, before any encoder loads, when that does not fit either."""
    pinned = need["vl"] * host.ranks_per_node
    figures = (
        f"the VL encoder {need['vl'] / GB:.1f} GB + VAE {need['vae'] / GB:.1f} GB + the largest encode "
        f"{need['encode'] / GB:.1f} GB do not fit the {room / GB:.1f} GB that qwen_edit.memory.budget_gb "
        f"{budget / GB:.1f} leaves after the margin"
    )
    if need["streamed"] + need["vae"] + need["encode"] > room or pinned > host.room_bytes:
        raise PlanError(
            f"the latent cache cannot be built within the memory budget: {figures}, and streamed from "
            f"host memory the VL encoder needs {need['streamed'] / GB:.1f} GB on the GPU and "
            f"{pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es); "
            f"{host.available_bytes / GB:.1f} GB available). Build the cache on a larger GPU with "
            "python -m train.cache (the same config and dataset), raise budget_gb, or lower "
            "qwen_edit.data.area"
        )
    return (
        f"latent cache: {figures}, so the VL encoder is streamed block by block from {pinned / GB:.1f} GB of pinned "
        f"host memory (the project's block offloader; {need['streamed'] / GB:.1f} GB of it on the GPU at a time)"
    )
