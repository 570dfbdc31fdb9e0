"""The run's plan: before any model loads, fit the run to the GPU it meets, as fast as it can be within it. Counts
the sizes, measures the blocks at the largest shape bucket, chooses (train/plan/choice.py), writes the choice into
the config's free keys, sets torch's allocator, and prints the plan and its predicted peak. Also the budget and the
margin, and the host check of a config that runs as written. Without a GPU there is nothing to plan: the config
runs as written."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from train.plan import arch, explain
from train.plan.choice import choose
from train.plan.host import Host, node_host
from train.plan.keys import apply, configured_offload, fixed_settings, optimizer_offload_blocker, planned_fast_accum
from train.plan.measure import Measured, encode_transient, measure, measure_render
from train.plan.predict import Choice, Prediction, fits_host, host_bytes
from train.plan.sizes import GB, Sizes, bucket_sizes, count_sizes, moved_bytes
from train.plan.workload import Workload

ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's allocator settings; the user's win


def gpu_budget(budget_gb: float, device: torch.device) -> float:
    """The bytes the run may use: budget_gb, or (0) the device's free memory now; a budget_gb below the device
    caps the process there (torch's per-process fraction), so a smaller card is simulated faithfully."""
    free, total = torch.cuda.mem_get_info(device)
    if budget_gb <= 0:
        return float(free)
    if budget_gb * GB > total:
        raise explain.PlanError(
            f"qwen_edit.memory.budget_gb: {budget_gb} GB is more than "
            f"{torch.cuda.get_device_name(device)} has ({total / GB:.1f} GB); lower it or set 0 "
            "(the free memory)"
        )
    torch.cuda.set_per_process_memory_fraction(budget_gb * GB / total, device)
    return budget_gb * GB


def gpu_margin(margin_gb: float, budget: float) -> float:
    """The bytes kept free of `budget`: margin_gb, or (0) 1.5 GB + 5% of the budget (NCCL, the checkpoint writer,
    the allocator's fragmentation)."""
    return margin_gb * GB if margin_gb > 0 else 1.5 * GB + 0.05 * budget


def expandable_segments(device: torch.device) -> str:
    """Turn on torch's expandable segments for the rest of the run, unless the user configured torch's allocator: ""
    when nothing changed, else the plan line's note. Why: at 16 GB the 2509 step ran out of memory with 13.5 GB
    allocated and 2.5 GB cached but free in pieces too small for a 144 MiB request (docs/performance.md "Memory");
    segments that grow in place keep freed memory reusable for any size, torch's own remedy, which its error message
    names. Runs that offload nothing gain headroom too: at 141 GB from the cache the allocator's reserved peak fell
    from 140.1 to 134.1 GB at the same step time, room a dataset with several shape buckets needs. The segments
    cached so far (the plan's measurement) are released first."""
    if device.type != "cuda" or any(os.environ.get(e) for e in ALLOC_CONF_ENVS):
        return ""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    torch.cuda.empty_cache()
    return ", torch's expandable segments on (PYTORCH_CUDA_ALLOC_CONF set by you would be kept)"


def plan_run(cfg, d, variant: str, dataset) -> dict | None:
    """Plan the run's memory (the module docstring) and write the choice into `cfg`; prints the plan and its
    predicted peak, and returns them for summary.json. None when there is nothing to plan (memory.plan off, no
    GPU, the model-parallel mode); a budget_gb still caps the process then."""
    project = cfg.project
    if d.device.type != "cuda":
        return None
    budget = gpu_budget(project.memory.budget_gb, d.device)
    if project.parallel.mode != "zero2":
        return None
    host = node_host(cfg.world_size)
    if project.memory.plan == "off":
        check_offload_host(cfg, host)  # the config as written: its own offloaded blocks must fit the host
        return None
    return _plan(cfg, d, variant, dataset.bucket_keys(), budget, host)


def _plan(cfg, d, variant: str, bucket_keys: list, budget: float, host: Host) -> dict:
    """plan_run's plan within `budget` bytes: measured, chosen, applied to `cfg`, printed; its summary.json record."""
    from train.runtime.console import print0
    from train.runtime.engine import all_gather_objects
    from train.runtime.probes import reset_peak_memory

    t0 = time.perf_counter()
    project = cfg.project
    fixed = fixed_settings(cfg)
    online = project.data.cache == "off"
    work = run_workload(cfg, variant, bucket_keys)
    sizes = run_sizes(cfg, online)
    render = validation_workload(project, variant) if project.validation.file else None
    if render is not None:
        sizes = dataclasses.replace(sizes, vae_bytes=arch.component_bytes(project.model.path, "vae"))
    fp8_ok = project.train.mode == "lora" and torch.cuda.get_device_capability(d.device) >= (8, 9)
    fast_accum = planned_fast_accum(cfg, fixed.get("train.fp8_base", fp8_ok))
    measured = _measure_run(
        project, d.device, work, render, getattr(torch, cfg.precision), fixed, fp8_ok, online, fast_accum
    )
    # One plan for every rank: the smallest budget of any rank, rank 0's measurement (timings differ a little).
    gathered = all_gather_objects((budget, measured))
    budget, measured = min(b for b, _ in gathered), gathered[0][1]
    margin = gpu_margin(project.memory.margin_gb, budget)
    blocker = optimizer_offload_blocker(cfg.deepspeed, sizes, host)
    result = choose(sizes, measured, budget, margin, fixed, fp8_ok, online, blocker, host)
    choice, pred = explain.choice_or_refusal(result, sizes, host, fixed)
    render_words = explain.render_note(
        sizes, measured, choice, pred, budget, margin, fixed, fp8_ok, online, blocker, host
    )
    apply(cfg, choice, sizes.num_blocks)
    allocator_words = expandable_segments(d.device)
    reset_peak_memory(d.device)  # the run's logged peak starts here, not at the measurement
    tokens = work.batch * (work.image_tokens + work.text_tokens)
    print0(
        explain.plan_line(
            time.perf_counter() - t0,
            budget,
            margin,
            tokens,
            choice,
            pred,
            sizes,
            host,
            project.train.compile,
            allocator_words,
            render_words,
        ),
        rank=d.rank,
    )
    return {
        "budget_gb": budget / GB,
        "margin_gb": margin / GB,
        "tokens": tokens,
        "host_available_gb": host.available_bytes / GB,
        "ranks_per_node": host.ranks_per_node,
        "predicted_host_pinned_gb": host_bytes(sizes, choice, host) / GB,
        **_plan_record(choice, pred, sizes, measured, render),
    }


def run_workload(cfg, variant: str, bucket_keys: list) -> Workload:
    """The run's largest micro-batch: its largest bucket, with the prompt's bound for the most references."""
    project = cfg.project
    refs = max(len(k) - 1 for k in bucket_keys)
    return arch.largest_bucket(
        bucket_keys,
        cfg.micro_batch_size,
        arch.text_tokens_bound(variant, refs, project.data.area, project.data.condition_area),
        variant,
    )


def run_sizes(cfg, online: bool) -> Sizes:
    """count_sizes for this run's model and LoRA, with its DeepSpeed ZeRO stage and data-parallel world (how the
    trainable state is split over the ranks) and, online, the encoders that share the GPU and whether they encode
    ahead."""
    project = cfg.project
    sizes = count_sizes(
        project.model.path,
        project.lora.target_modules,
        project.lora.rank,
        arch.encoder_weight_bytes(project.model.path) if online else 0,
        project.train.mode == "full",
    )
    stage = (cfg.deepspeed.get("zero_optimization") or {}).get("stage", 0)
    return dataclasses.replace(
        sizes,
        zero_stage=stage,
        dp_world=cfg.world_size,
        encode_ahead=online and project.data.encode_ahead,
        accumulating=cfg.deepspeed.get("gradient_accumulation_steps", 1) > 1,
        **bucket_sizes(cfg.deepspeed),
    )


def _measure_run(
    project,
    device: torch.device,
    work: Workload,
    render: Workload | None,
    dtype: torch.dtype,
    fixed: dict,
    fp8_ok: bool,
    online: bool,
    fast_accum: bool,
) -> Measured:
    """This rank's measurement for the plan: the blocks at `work` (an fp8 base's matmuls with fast accumulation when
    `fast_accum`), then online encoding's bytes and the validation render's transients when they apply."""
    fp8_base = fixed.get("train.fp8_base", fp8_ok)
    measured = measure(
        project.model.path,
        work,
        dtype,
        device,
        project.train.mode,
        project.lora,
        fp8_base,
        fixed.get("train.compile", True),
        fixed.get("train.kept_attention_blocks", -1) != 0,
        fast_accum,
    )
    if online:
        measured = dataclasses.replace(
            measured, encode_bytes=encode_transient(project.model.path, device, work, project.model.vae_2d_frames)
        )
    if render is not None:
        measured = measure_render(
            measured,
            project.model.path,
            render,
            dtype,
            arch.encoder_dtype(project.model.encoder_dtype, device),
            device,
            project.train.mode,
            project.lora,
            fp8_base,
            online,
            project.model.vae_2d_frames,
        )
    return measured


def _plan_record(choice: Choice, pred: Prediction, sizes: Sizes, measured: Measured, render: Workload | None) -> dict:
    """The chosen settings, predictions and measurements as summary.json records them."""
    return {
        "choice": explain.describe(choice, sizes.num_blocks),
        "predicted_peak_gb": pred.peak_bytes / GB,
        "offload_optimizer": choice.offload_optimizer,
        "predicted_host_step_s": pred.optimizer_s,
        "render_tokens": render and render.image_tokens + render.text_tokens,
        "predicted_render_peak_gb": pred.render_peak_bytes / GB if render else None,
        "vae_tiling": choice.vae_tiling,
        "measured": {
            k: None if isinstance(v, float) and math.isinf(v) else v  # inf: did not fit alone
            for k, v in measured.__dict__.items()
        },
    }


def validation_workload(project, variant: str) -> Workload:
    """render_workload of validation.file's edits at the inference section's areas (the images' headers read)."""
    sizes = arch.validation_reference_sizes(project.validation.file, project.train.seed)
    return arch.render_workload(sizes, variant, project.inference.area, project.inference.condition_area)


def offload_share(model_dir: str | Path, lora, blocks: int, fp8_base: bool, dtype_bytes: int):
    """The node's shared host copy (offload.node_share) of the first `blocks` offloaded blocks, sized as host_bytes
    counts them, or None (nothing offloaded, one process, no room in /dev/shm). A collective."""
    if not blocks:
        return None
    from train.model import offload

    sizes = count_sizes(model_dir, lora.target_modules, lora.rank)
    return offload.node_share(blocks * moved_bytes(sizes, fp8_base, dtype_bytes))


def check_offload_host(cfg, host: Host) -> None:
    """PlanError, before anything loads, when the config's own train.offload_blocks (with its fp8_base and
    DeepSpeed's optimizer offload as written) does not fit this node's host memory."""
    project = cfg.project
    if not project.train.offload_blocks:
        return
    s = count_sizes(project.model.path, project.lora.target_modules, project.lora.rank, 0, project.train.mode == "full")
    k = min(project.train.offload_blocks, s.num_blocks)
    c = Choice(project.train.fp8_base, False, k, k, True, bool(configured_offload(cfg.deepspeed)))
    if not fits_host(s, c, host):
        blocks = project.train.offload_blocks
        raise explain.PlanError(
            f"qwen_edit.train.offload_blocks = {blocks} does not fit this node's host memory: the "
            "offloaded blocks need "
            f"{explain.host_refusal(s, c, host, {'train.offload_blocks': blocks})}"
        )
