"""Benchmark of the training input path: online encoding vs the latent/embedding cache
(train/data/latent_cache.py); the command train/bench_data.py, its arguments parse_args's.

Two phases over the same synthetic edit rows (micro-batch 1, the trainer's own loader, sampler and sources):

- online: `pairs.EditDataset` (decode + resize) -> `sources.online_source` (Qwen2.5-VL + VAE encode) on the device;
- cached: the rows are first precomputed with `latent_cache.write_cache` (timed too), the encoders are freed, then
  `cache_reader.CachedDataset` (read the shard) -> `cache_reader.to_batch` (to the device).

Each reports samples/s and the fraction of the time spent waiting for the loader; the online phase also the
seconds of each encoder on one micro-batch (time_encode_parts; the VAE's parts both ways, model.vae_2d_frames on
and off, whichever `--vae_2d_frames` the phases run with). With `--train_step` every
micro-batch also runs the trainer's step (`loop.forward_loss`, `engine.backward`, `engine.step` on the ZeRO-2
engine, LoRA r64 on the attention projections, as train.bench): that is the end-to-end figure the cache must
raise (goal: cached >= 1.2x online on the 1024^2 Edit v1 workload). The encoders' memory (their weights, and on
a GPU the allocated memory they give back when freed) is reported too.

Default models: Qwen2.5-VL-7B (8.3 B; the released text and vision sizes), the released VAE architecture and,
with --train_step, the full Qwen-Image transformer (the family's released sizes), all at random init, built directly
on the device in bf16; nothing is downloaded. The processor is the released one's settings with a small BPE
tokenizer trained here (prompts tokenise into more, shorter tokens than with Qwen's vocabulary).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from train.benchmarks import options
from train.benchmarks.build import build_full_transformer, lora_config, make_config, prepare_training
from train.benchmarks.report import machine
from train.benchmarks.timing import sync
from train.benchmarks.workload import FAMILY, SEED, make_workload
from train.config.files import transformer_class
from train.data import cache_reader, latent_cache, pairs, sources
from train.model import family
from train.model.interface import Encoders
from train.plan.measure import peak_above
from train.runtime import engine
from train.trainer import loop

# Numbers > 0 in every record (the CI smoke test checks them).
NUMERIC_FIELDS = ("online_samples_per_s", "cached_samples_per_s", "speedup", "precompute_samples_per_s",
                  "encoder_params", "encoder_weights_gb", "cache_mb_per_sample", "samples", "area", "width", "height",
                  "encode_vl_s", "encode_vl_processor_s", "encode_vae_target_s", "encode_vae_references_s",
                  "encode_batch_s", "encode_vae_target_2d_s", "encode_vae_target_3d_s", "encode_vae_references_2d_s",
                  "encode_vae_references_3d_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Samples/s of the training input: online encoding vs the cache")
    p.add_argument("--tiny", action="store_true", help="the tiny model of train.make_tiny (CPU smoke), fp32")
    p.add_argument("--variant", choices=("edit", "edit_plus"), default="edit")
    p.add_argument("--area", type=int, help="target pixel area (default 1024*1024; 128*128 with --tiny)")
    p.add_argument("--samples", type=int, default=32, help="timed samples per phase (default 32)")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples first (default 2)")
    p.add_argument("--num_workers", type=int, default=2, help="DataLoader workers (default 2, as data.num_workers)")
    p.add_argument("--train_step", action="store_true", help="also run the trainer's step on every micro-batch")
    p.add_argument("--num_layers", type=int, help="transformer depth for --train_step (default 60)")
    p.add_argument("--vae_2d_frames", choices=("on", "off"), default="on",
                   help="model.vae_2d_frames for the timed phases (default on); the VAE parts are timed both ways")
    p.add_argument("--json", help="append the result as one JSON line to this file")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 0 or args.num_workers < 0:
        p.error("--samples must be >= 1, --warmup and --num_workers >= 0")
    args.area = args.area or (128 * 128 if args.tiny else 1024 * 1024)
    return args


# ---------------------------------------------------------------- models and data


def build_inputs(args: argparse.Namespace, work: Path, device: torch.device, dtype: torch.dtype):
    """(rows, dataset, encoders, transformer or None): synthetic edits at the workload size and the models (the
    tiny checkpoint's, or the released encoders' sizes at random init)."""
    num_rows, side = args.warmup + args.samples, make_workload(args.area, 1, 1, 1).width
    fam = family.variant_family(args.variant)
    if args.tiny:
        fam.make_tiny(work, args.variant, num_samples=num_rows, size=side)
        encoders = fam.load_encoders(work / "model", dtype, device, vae_2d_frames=args.vae_2d_frames == "on")
    else:
        fam.make_dataset(work / "data", args.variant, num_rows, side)
        encoders = fam.bench.full_encoders(work / "data", device, dtype, args.vae_2d_frames == "on")
    rows, _ = pairs.read_rows(work / "data")
    dataset = pairs.EditDataset(work / "data", rows, args.variant, args.area, 384 * 384 if not args.tiny else 64 * 64)
    transformer = build_transformer(args, work, device, dtype) if args.train_step else None
    return rows, dataset, encoders, transformer


def build_transformer(args: argparse.Namespace, work: Path, device: torch.device, dtype: torch.dtype):
    """The transformer with LoRA r64 on the attention projections (as train.bench), seeded."""
    torch.manual_seed(SEED)
    if args.tiny:
        model = transformer_class(work / "model" / "transformer").from_pretrained(work / "model",
                                                                                  subfolder="transformer").to(device)
    else:
        model = build_full_transformer(args.num_layers, device, dtype)
    prepare_training(model, "lora", lora_config(64, "attn"), "none", False)
    return model


def encoder_stats(encoders: Encoders) -> dict:
    params = sum(p.numel() for m in (encoders.text_encoder, encoders.vae) for p in m.parameters())
    nbytes = sum(p.numel() * p.element_size() for m in (encoders.text_encoder, encoders.vae) for p in m.parameters())
    return {"encoder_params": params, "encoder_weights_gb": nbytes / 1e9}


def free(device: torch.device) -> float:
    """Collect garbage; the GPU memory still allocated afterwards (GB; 0 on CPU)."""
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 1e9


# ---------------------------------------------------------------- timing


def step_fn(transformer, d: engine.Dist, dtype: torch.dtype, args: argparse.Namespace):
    """f(batch, i): the trainer's micro-step on `batch` (ZeRO-2 engine over the LoRA parameters), or a sync."""
    if transformer is None:
        return lambda b, i: sync(d.device)
    # train.bench's defaults: micro-batch 1, LoRA r64 on the attention projections, ZeRO-2, AdamW
    defaults = options.parse_args(["--steps", str(args.samples), "--warmup", str(args.warmup)])
    cfg = make_config(defaults, d.world_size, d.device.type == "cuda", dtype)
    eng, _ = engine.build_engine(transformer, cfg.deepspeed)
    eng.train()
    t, gas = cfg.project.train, cfg.deepspeed["gradient_accumulation_steps"]

    def step(b: sources.Batch, i: int) -> None:
        generator = loop.micro_batch_generator(t.seed, i, 0, gas, d, d.device)
        eng.backward(loop.forward_loss(eng, b, t, generator, FAMILY.bench.SCHEDULER, dtype, FAMILY))
        eng.step()
        sync(d.device)

    return step


def time_source(source: sources.LoaderSource, step, warmup: int, samples: int) -> dict:
    """samples/s over `samples` micro-batches after `warmup`, and the fraction of that time spent in the loader."""
    source.start_epoch(0, 0)
    it = iter(source)
    for i in range(warmup):
        step(next(it), i)
    source.take_wait_s()
    start = time.perf_counter()
    for i in range(warmup, warmup + samples):
        step(next(it), i)
    elapsed = time.perf_counter() - start
    return {"samples_per_s": samples / elapsed, "data_wait_fraction": source.take_wait_s() / elapsed}


def time_encode_parts(dataset, encoders: Encoders, variant: str, device: torch.device, repeats: int) -> dict:
    """Seconds per micro-batch of each part of online encoding (sources.encode_batch) on the first row, the mean of
    `repeats` after one warm-up, synchronised: Qwen2.5-VL (processor included), its processor alone (tokenising,
    resizing and patching the images on the host, then the copy to the device), the VAE on the target, on the
    references, and all of encode_batch; then the two VAE parts again with model.vae_2d_frames on (`*_2d_s`) and
    off (`*_3d_s`, diffusers' own path), in the same process, and on a GPU each way's encode peak above the
    allocated memory (`*_peak_gb`)."""
    hooks = family.variant_family(variant).bench
    parts = hooks.encode_parts(pairs.collate([dataset[0]]), encoders, variant)
    out = time_calls(parts, device, repeats)
    vae_parts = {name: parts[f"{name}_s"] for name in ("encode_vae_target", "encode_vae_references")}
    configured = hooks.vae_path(encoders.vae)
    for suffix, switch in hooks.VAE_PATHS.items():
        switch(encoders.vae)
        out.update(time_calls({f"{name}_{suffix}_s": call for name, call in vae_parts.items()}, device, repeats))
        if device.type == "cuda":
            out[f"encode_vae_target_{suffix}_peak_gb"] = peak_above(device, vae_parts["encode_vae_target"]) / 1e9
    hooks.VAE_PATHS[configured](encoders.vae)
    return out


def time_calls(parts: dict, device: torch.device, repeats: int) -> dict:
    """{name: seconds per call}: the mean of `repeats` after one warm-up, synchronised."""
    out = {}
    for name, call in parts.items():
        call()
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        sync(device)
        out[name] = (time.perf_counter() - start) / repeats
    return out


def make_loader(dataset, args: argparse.Namespace, collate_fn=pairs.collate):
    return pairs.build_loader(dataset, 1, 0, 1, SEED, args.num_workers, True, False, collate_fn=collate_fn)


def run(args: argparse.Namespace, d: engine.Dist, work: Path) -> dict:
    dtype = torch.bfloat16 if d.device.type == "cuda" and not args.tiny else torch.float32
    base = free(d.device)
    rows, dataset, encoders, transformer = build_inputs(args, work, d.device, dtype)
    record = {**encoder_stats(encoders), "encoder_gpu_memory_gb": 0.0}
    with_encoders = free(d.device)
    step = step_fn(transformer, d, dtype, args)
    online = time_source(sources.online_source(make_loader(dataset, args), encoders, args.variant), step,
                         args.warmup, args.samples)
    record.update(time_encode_parts(dataset, encoders, args.variant, d.device, max(1, min(args.samples, 5))))
    start = time.perf_counter()
    latent_cache.write_cache(work / "cache", dataset, rows, encoders, args.variant, {"bench": "bench_data"}, d,
                      args.num_workers)
    precompute_s = time.perf_counter() - start
    before_free = free(d.device)
    del encoders
    record["encoder_gpu_memory_gb"] = before_free - free(d.device)  # what training from the cache never holds
    index = latent_cache.read_index(work / "cache")
    cached_ds = cache_reader.CachedDataset(work / "cache", index, rows)
    source = sources.LoaderSource(make_loader(cached_ds, args, cache_reader.collate),
                                  lambda raw: cache_reader.to_batch(raw, d.device))
    cached = time_source(source, step, args.warmup, args.samples)
    cache_bytes = sum(f.stat().st_size for f in (work / "cache").glob("shard-*"))
    w = make_workload(args.area, 1, 1, 1)
    return {
        **record, "online_samples_per_s": online["samples_per_s"], "cached_samples_per_s": cached["samples_per_s"],
        "speedup": cached["samples_per_s"] / online["samples_per_s"],
        "online_data_wait_fraction": online["data_wait_fraction"],
        "cached_data_wait_fraction": cached["data_wait_fraction"],
        "precompute_samples_per_s": len(rows) / precompute_s, "cache_mb_per_sample": cache_bytes / len(rows) / 1e6,
        "gpu_memory_gb_models_loaded": with_encoders - base, "train_step": args.train_step,
        "model": "tiny" if args.tiny else "full architectures (random init)", "variant": args.variant,
        "precision": str(dtype).removeprefix("torch."), "samples": args.samples, "warmup": args.warmup,
        "num_workers": args.num_workers, "vae_2d_frames": args.vae_2d_frames,
        "area": args.area, "width": w.width, "height": w.height, **machine(d),
    }


def format_report(r: dict) -> str:
    step = "input + trainer step (LoRA r64, ZeRO-2)" if r["train_step"] else "input only (no trainer step)"
    return "\n".join([
        f"== train.bench_data: {step}, {r['model']}, {r['variant']} {r['width']}x{r['height']}, {r['precision']} ==",
        f"machine      {r['gpu_name']}, torch {r['torch_version']}, {r['date']}",
        *(f"{phase:<12} {r[phase + '_samples_per_s']:.3f} samples/s (waiting for data "
          f"{100 * r[phase + '_data_wait_fraction']:.1f}% of the time)" for phase in ("online", "cached")),
        f"online parts Qwen2.5-VL {r['encode_vl_s']:.3f} s (its processor {r['encode_vl_processor_s']:.3f} s), "
        f"VAE target {r['encode_vae_target_s']:.3f} s, VAE references {r['encode_vae_references_s']:.3f} s; "
        f"encode_batch {r['encode_batch_s']:.3f} s per micro-batch (vae_2d_frames {r['vae_2d_frames']})",
        f"VAE 2D/3D    target {r['encode_vae_target_2d_s']:.3f} / {r['encode_vae_target_3d_s']:.3f} s, references "
        f"{r['encode_vae_references_2d_s']:.3f} / {r['encode_vae_references_3d_s']:.3f} s (model.vae_2d_frames on / off"
        + (f"; target encode peak {r['encode_vae_target_2d_peak_gb']:.2f} / {r['encode_vae_target_3d_peak_gb']:.2f} GB)"
           if "encode_vae_target_2d_peak_gb" in r else ")"),
        f"speedup      {r['speedup']:.2f}x cached / online",
        f"precompute   {r['precompute_samples_per_s']:.3f} samples/s, {r['cache_mb_per_sample']:.3f} MB per sample",
        f"encoders     {r['encoder_params'] / 1e9:.3f} B parameters, {r['encoder_weights_gb']:.3f} GB of weights; "
        f"GPU memory freed for cached training {r['encoder_gpu_memory_gb']:.2f} GB",
    ])
