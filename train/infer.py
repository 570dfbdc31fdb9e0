"""Batch inference: a model directory (+ LoRAs) and a jsonl of edits -> OUT/<name>.png, one per row.

    python -m train.infer --model DIR --input edits.jsonl --out OUT [--lora FILE[:WEIGHT] ...] [--config JSON]
    deepspeed --num_gpus N train/infer.py --model DIR --input edits.jsonl --out OUT ...      # data parallel
    python -m train.infer --placement split ...        # one process: encoders on cuda:0, transformer on cuda:1

Rows: {"edit_image": path or [paths], "prompt": str, "seed"?: int, "output"?: name}. Rank r renders rows r::W;
a row's seed defaults to --seed + its index, so the images do not depend on the number of processes. Outputs are
written atomically, and rows whose output exists are skipped: a killed run resumes by running it again. A bad row
(unparsable, missing or undecodable image, empty prompt) is reported with its line, listed in OUT/bad_rows.txt
and skipped; the exit status is 0 unless no row could be rendered (1), or the arguments are wrong (2).
With QWEN_EDIT_RANDOM_INIT=1 the models are built from their configs at random init (measurements on a directory
of configs alone, as `python -m train.make_tiny --full_size_configs` writes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the deepspeed launcher): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import train.runtime.quiet  # noqa: F401  (first: it quiets the libraries before they are imported)
from train import config
from train.config import files
from train.model import family, loading, lora_io, placement, renders, support
from train.model.interface import Encoders
from train.plan import inference
from train.plan.explain import PlanError
from train.plan.host import Host, node_host
from train.runtime import engine, gpumon
from train.runtime.console import prefix_rank_output, print0, progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Batch inference of Qwen-Image-Edit (v1, 2509, 2511) and Qwen-Image "
                                                 "(2512) with LoRAs, through the diffusers pipelines")
    parser.add_argument("--model", required=True, help="local diffusers-format directory of Qwen-Image-Edit, -2509, "
                                                       "-2511 or Qwen-Image (model_index.json inside)")
    parser.add_argument("--input", required=True, help="jsonl of edits (paths relative to its folder)")
    parser.add_argument("--out", required=True, help="output directory: OUT/<name>.png per row")
    parser.add_argument("--lora", action="append", default=[], metavar="FILE[:WEIGHT]",
                        help="LoRA .safetensors to apply (repeatable), optionally with a weight (default 1.0)")
    parser.add_argument("--config", help="JSON with a qwen_edit.inference section (a training config will do)")
    parser.add_argument("--seed", type=int, default=0, help="base seed: a row without 'seed' gets base + its index")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weights' precision; auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--placement", default="single", choices=["single", "split"],
                        help="single: the whole pipeline on this process's device; split: text encoder + VAE on "
                             "cuda:0, transformer on cuda:1 (one process, for a model too big for one GPU)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> list[str]:
    """Problems with the arguments, each naming the flag and the fix."""
    problems = files.model_dir_problems(args.model, "--model")  # the same pre-flight as training's
    if not Path(args.input).is_file():
        problems.append(f"--input: {args.input!r} does not exist")
    else:
        try:
            renders.read_requests(args.input)
        except ValueError as e:  # a file that is not UTF-8 text
            problems.append(f"--input: {e}")
    for spec in args.lora:
        path, weight = placement.parse_lora(spec)
        if not path.is_file():
            problems.append(f"--lora: {str(path)!r} is not a file (FILE[:WEIGHT], e.g. export/lora.safetensors:0.8)")
        elif not math.isfinite(weight):
            problems.append(f"--lora {spec}: the weight {weight} is not a finite number; write FILE:0.8")
        else:
            problems += [f"--lora: {problem}" for problem in lora_io.check_file(path)]
    if args.seed < 0:
        problems.append("--seed: must be >= 0")
    if args.placement == "split":
        if world_size > 1:
            problems.append("--placement split: runs in one process on two GPUs; start it with python -m train.infer, "
                            "not under the deepspeed launcher")
        if torch.cuda.device_count() < 2:
            problems.append(f"--placement split: needs 2 GPUs, {torch.cuda.device_count()} visible")
    return problems


def build_pipeline(args: argparse.Namespace, settings: config.ProjectConfig, d: engine.Dist):
    """(pipeline, variant) on this process's device(s), LoRAs loaded, memory options applied (inference.cpu_offload
    as the plan set it)."""
    fam, variant = family.detect(args.model, settings.model.variant)
    device = torch.device("cuda", 0) if args.placement == "split" else d.device
    dtype = loading.encoder_dtype(args.dtype, device)
    pipe = fam.load_pipeline(args.model, dtype, variant, random_models(args, settings, device, dtype),
                             settings.model.vae_2d_frames)
    placement.load_loras(pipe, [placement.parse_lora(spec) for spec in args.lora])
    placement.place(pipe, settings.inference, device, args.placement, torch.device("cuda", 1))
    return pipe, variant


def plan(args: argparse.Namespace, settings: config.ProjectConfig, d: engine.Dist) -> inference.InferencePlacement:
    """The memory plan's placement on this process's device (printed), which sets inference.cpu_offload."""
    host = node_host(d.world_size) if d.device.type == "cuda" else Host()  # a collective
    requests, _ = renders.read_requests(args.input, args.seed)
    most = max((len(q.references) for q in requests), default=0)
    line, placed = inference.plan_inference(args.model, settings, config.explicit_keys(args.config), d.device, host,
                                            most)
    if line:
        print0(line, rank=d.rank)
    return placed


def encode_rows(args: argparse.Namespace, settings: config.ProjectConfig, d: engine.Dist, todo: list, variant: str,
                stream: bool):
    """cpu_offload "blocks", first phase: the encoders alone on the device (the VL encoder streamed when `stream`)
    record every row's conditioning as validation records it; the text encoder then leaves. Returns (the VAE,
    {index: recording in host memory}, bad rows as (line, problem))."""
    from train.trainer import replay

    fam = family.variant_family(variant)
    dtype = loading.encoder_dtype(args.dtype, d.device)
    encoders = fam.load_encoders(args.model, dtype, d.device, stream_text_encoder=stream,
                                 vae_2d_frames=settings.model.vae_2d_frames)
    pipe = fam.pipeline_from_components(args.model, variant, replay.shape_only_transformer(args.model), encoders)
    recorded, bad = {}, []
    with replay.preserved_training_state(encoders.vae, encoders.vae, settings.inference.vae_tiling,
                                         settings.inference.vae_slicing):
        for request in progress(todo, desc=f"encode (rank 0 of {d.world_size})", unit="row",
                                disable=not d.is_main, file=sys.stdout):
            problem = renders.check_request(request, variant, settings.inference.area,
                                             settings.inference.condition_area, encoders.processor)
            if problem is None:  # kept in host memory until its render (replay moves it back)
                recorded[request.index] = [(name, _to_host(out)) for name, out in replay.record_conditioning(
                    pipe, variant, request, settings.inference, settings.data.alpha_background)]
            else:
                print(f"bad row: line {request.line}: {problem}; skipped", file=sys.stderr, flush=True)
                bad.append((request.line, problem))
    vae = encoders.vae
    del pipe, encoders
    _free(d.device)
    return vae, recorded, bad


def _to_host(out):
    """A recorded encoder output (a tensor, or a tuple of tensors and None) in host memory."""
    if torch.is_tensor(out):
        return out.cpu()
    return tuple(None if t is None else t.cpu() for t in out)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def streaming_pipeline(args: argparse.Namespace, variant: str, vae, offload: int, d: engine.Dist):
    """cpu_offload "blocks", second phase: a pipeline of the transformer (LoRAs loaded) and the VAE alone, the
    transformer's first `offload` blocks keeping their matrices in pinned host memory (train/model/offload.py, the
    next block prefetched on a side stream), everything else on the device."""
    from train.model import offload as offloading
    from train.model import streaming

    fam = family.variant_family(variant)
    dtype = loading.encoder_dtype(args.dtype, d.device)
    blocks = set(range(offload))
    transformer, _ = loading.streamed_transformer(args.model, streaming.Placement(d.device, dtype, offload=blocks),
                                                  frozen=True)
    encoders = Encoders(text_encoder=None, processor=None, vae=vae)
    pipe = fam.pipeline_from_components(args.model, variant, transformer, encoders)
    placement.load_loras(pipe, [placement.parse_lora(spec) for spec in args.lora])
    transformer.requires_grad_(False).eval()
    if blocks:
        transformer.block_offloader = offloading.BlockOffloader(
            {i: fam.blocks(transformer)[i] for i in sorted(blocks)}, d.device)
    return pipe


def _replayed(recorded: dict, device: torch.device, fam, pipe, request: renders.EditRequest):
    """Inside, `pipe` (of family `fam`) replays the request's recorded conditioning (moved to `device`) instead of
    encoding."""
    from train.trainer import replay

    return replay.replayed_conditioning(fam.sampling_pipeline(pipe, bool(request.references)),
                                        recorded[request.index], device)


STREAMED_CHUNK_ROWS = 256  # rows encoded, then rendered, at a time: their recordings wait in host memory (~16 MB
# a row at 1 MP with two references and guidance); each chunk loads the encoders, then the transformer, once


def render_streamed(args: argparse.Namespace, settings: config.ProjectConfig, d: engine.Dist, todo: list,
                    placed: inference.InferencePlacement):
    """cpu_offload "blocks": chunk by chunk (STREAMED_CHUNK_ROWS), encode the rows, then render them with the
    recorded conditioning; returns (written, bad rows as (line, problem), seconds per image rendered)."""
    fam, variant = family.detect(args.model, settings.model.variant)
    written, bad, seconds = 0, [], []
    for start in range(0, len(todo), STREAMED_CHUNK_ROWS):
        chunk = todo[start:start + STREAMED_CHUNK_ROWS]
        if len(todo) > STREAMED_CHUNK_ROWS:
            print0(f"rows {start + 1}-{start + len(chunk)} of this rank's {len(todo)}", rank=d.rank)
        vae, recorded, bad_rows = encode_rows(args, settings, d, chunk, variant, placed.stream_text_encoder)
        pipe = streaming_pipeline(args, variant, vae, placed.offload_blocks, d)
        if settings.inference.vae_tiling:
            vae.enable_tiling()
        if settings.inference.vae_slicing:
            vae.enable_slicing()
        done, bad_images, times = render_rows(pipe, variant, [q for q in chunk if q.index in recorded], args,
                                              settings, d, functools.partial(_replayed, recorded, vae.device, fam))
        written, bad, seconds = written + done, bad + bad_rows + bad_images, seconds + times
        del pipe, vae, recorded
        _free(d.device)
    return written, bad, seconds


def random_models(args: argparse.Namespace, settings: config.ProjectConfig, device: torch.device,
                  dtype: torch.dtype) -> dict:
    """Under QWEN_EDIT_RANDOM_INIT=1 the pipeline's models at random init, each built where `place` will keep it
    (host memory for CPU offload, cuda:1 for the split transformer), as training builds them; else none ({})."""
    if not files.random_init():
        return {}
    split = args.placement == "split"
    on_host = not split and settings.inference.cpu_offload != "none" and device.type == "cuda"
    fam = family.family_of(args.model, settings.model.variant)
    return fam.random_pipeline_models(args.model, dtype, device, torch.device("cuda", 1) if split else device,
                                      on_host)


def select_rows(args: argparse.Namespace, d: engine.Dist):
    """This rank's share: (requests to render, already done count, bad rows as (line, problem))."""
    requests, problems = renders.read_requests(args.input, args.seed)
    bad = [(line, msg) for index, line, msg in problems if index % d.world_size == d.rank]
    mine = [q for q in requests if q.index % d.world_size == d.rank]
    todo = [q for q in mine if not output_path(args.out, q).is_file()]
    return todo, len(mine) - len(todo), bad


def output_path(out_dir: str, request: renders.EditRequest) -> Path:
    return Path(out_dir) / f"{request.name}.png"


def render_rows(pipe, variant: str, todo: list, args: argparse.Namespace, settings, d: engine.Dist,
                replay=None):
    """Render and write every request of `todo`; returns (written, bad rows as (line, problem), seconds per image
    rendered). replay: (pipe, request) -> the context in which the pipeline replays the request's recorded
    conditioning (None: the pipeline encodes)."""
    written, bad, seconds = 0, [], []
    fam = family.variant_family(variant)
    for request in progress(todo, desc=f"infer (rank 0 of {d.world_size})", unit="image", disable=not d.is_main,
                            file=sys.stdout):
        problem = renders.check_request(request, variant, settings.inference.area,
                                         settings.inference.condition_area, getattr(pipe, "processor", None))
        if problem is None:
            images = renders.open_references(request, settings.data.alpha_background, fam.rgba)
            start = time.perf_counter()
            with (replay(pipe, request) if replay else contextlib.nullcontext()):
                image = fam.sample(pipe, variant, images, request.prompt, request.seed, settings.inference)
            seconds.append(time.perf_counter() - start)
            try:
                renders.save_png_atomic(image, output_path(args.out, request))
                written += 1
            except OSError as e:  # a name the file system refuses (or a full disk): this row only
                problem = f"cannot write {output_path(args.out, request)} ({e.strerror or e})"
        if problem is not None:
            print(f"bad row: line {request.line}: {problem}; skipped", file=sys.stderr, flush=True)
            bad.append((request.line, problem))
    return written, bad, seconds


def run(args: argparse.Namespace, settings: config.ProjectConfig, d: engine.Dist) -> int:
    """Render this rank's rows; rank 0 writes the report and summary. Returns the exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    monitor = gpumon.start_monitor(out, settings.output.gpu_monitor_interval_s, d.local_rank, gpumon.node_rank())
    try:
        todo, done, bad = select_rows(args, d)
        for line, problem in bad:
            print(f"bad row: line {line}: {problem}; skipped", file=sys.stderr, flush=True)
        written, seconds = 0, []
        try:  # on every rank, with rows to render or not: the host's count is a collective
            placed = plan(args, settings, d) if args.placement == "single" else None
        except PlanError as e:  # the same on every rank, before anything loads: no traceback
            print0(f"error: {e}", rank=d.rank, file=sys.stderr)
            return 2
        if todo:
            if placed is not None and placed.cpu_offload == "blocks":
                written, bad_images, seconds = render_streamed(args, settings, d, todo, placed)
            else:
                pipe, variant = build_pipeline(args, settings, d)
                written, bad_images, seconds = render_rows(pipe, variant, todo, args, settings, d)
            bad += bad_images
    finally:
        gpus = monitor.stop()
    peak = torch.cuda.max_memory_allocated(d.device) / 1e9 if d.device.type == "cuda" else None
    counts = engine.all_gather_objects((written, done, bad, gpus, seconds, peak))
    written, done = sum(c[0] for c in counts), sum(c[1] for c in counts)
    bad = sorted(b for c in counts for b in c[2])
    if d.is_main:
        report = out / "bad_rows.txt"
        if bad:
            report.write_text("".join(f"line {line}: {problem}\n" for line, problem in bad))
        elif report.exists():
            report.unlink()  # from an earlier run whose rows have been fixed
        # seconds_per_image: each rank's renders, in order (the first includes the warm-up); peak_memory_gb: torch's
        # max allocated on each rank's device (None on the CPU); gpus: NVML's view (peak used, utilisation)
        summary = {"written": written, "already_done": done, "bad_rows": len(bad), "world_size": d.world_size,
                   "seconds_per_image": [[round(t, 3) for t in c[4]] for c in counts],
                   "peak_memory_gb": [None if c[5] is None else round(c[5], 3) for c in counts],
                   "gpus": [g for c in counts for g in c[3]]}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print0(f"wrote {written} images into {out}, {done} were already there, {len(bad)} bad row(s)"
               + (f" (listed in {report})" if bad else ""))
    return 1 if bad and not (written or done) else 0


def main(argv: list[str] | None = None) -> int:
    prefix_rank_output()
    args = parse_args(argv)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    problems = check_args(args, world_size)
    try:
        engine.check_processes(rank)
    except engine.TooManyProcessesError as e:
        problems.append(str(e))
    try:
        settings = config.inference_settings(args.config)
    except config.ConfigError as e:
        problems += e.problems
    if not problems:
        try:
            fam, _ = family.detect(args.model, settings.model.variant)
            problems += support.unsupported(fam, settings, support.INFER)
        except family.ModelError as e:
            problems.append(str(e))
    if problems:
        print0("error: " + "\n  - ".join(["invalid arguments:", *problems]), rank=rank, file=sys.stderr)
        return 2
    try:
        d = engine.init_distributed(settings.parallel.collective_timeout_s)
    except engine.PortInUseError as e:
        return engine.refuse_early(e, rank)
    code = run(args, settings, d)
    engine.teardown()  # not after a crash: the other ranks would wait in it (the launcher stops them instead)
    return code


if __name__ == "__main__":
    engine.exit_with(main)
