"""The builders of a training run and the run itself, shared by the commands (train/main.py, train/cache.py) and the
model-parallel runner: the data (pre-flight, dataset, loader), the source of encoded micro-batches (cache or online
encoders), the transformer in its training form, the first writes into the output directory, the exports, and `run`
(ZeRO-2 data parallel: build, resume, train, validate, export).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from train import config
from train.data import cache_reader, pairs, prompts, sources
from train.data.rows import check_references, fingerprint
from train.model import family, fp8, kept_attention, loading, lora_io, prepare
from train.model.interface import ModelFamily
from train.plan import run_plan
from train.runtime import checkpoint, diskspace, engine, exports, gpumon, outdir, preempt, resume_changes, steptime
from train.runtime.console import print0
from train.runtime.oom import out_of_memory
from train.runtime.plot import write_loss_curve
from train.runtime.record import Metrics, NullMetrics
from train.trainer import loop, replay, validation


def build_data(cfg: config.Config, d: engine.Dist, variant: str):
    """The pre-flight's rows (bad rows reported) and the DataLoader over them."""
    p = cfg.project
    processor = prompts.PromptProcessor.from_config(p.data)
    steps = pairs.aspect_steps(p.data.bucket_aspect_steps, cfg.micro_batch_size, p.data.buckets)
    rows = pairs.preflight(p.data.path, variant, p.data.bad_rows, d.rank, d.world_size,
                          report_path=Path(p.output.dir) / "bad_rows.txt", processor=processor,
                          category_rules=p.data.category_rules, area=p.data.area,
                          condition_area=p.data.condition_area,
                          tokens=family.variant_family(variant).prompt_tokenizer(p.model.path), steps=steps,
                          ignored=tuple(p.data.ignore_columns))
    record = next(v for v in family.variant_family(variant).variants if v.name == variant)
    unreferenced = check_references(rows, variant, p.data.rows_without_reference, record.text_to_image)
    dataset = pairs.EditDataset(p.data.path, rows, variant, p.data.area, p.data.condition_area,
                               p.data.alpha_background, steps)
    loader = pairs.build_loader(dataset, cfg.micro_batch_size, d.rank, d.world_size, p.train.seed,
                               p.data.num_workers, p.data.pin_memory, p.data.shuffle, buckets=p.data.buckets,
                               category_weights=p.data.category_weights, bucket_fill=p.data.bucket_fill)
    print0(f"{processor.report.summary()}\n{pairs.sampling_summary(loader.batch_sampler, rows)}", rank=d.rank)
    if unreferenced:
        print0(unreferenced, rank=d.rank)
    return rows, loader


def build_transformer(cfg: config.Config, device: torch.device | None = None):
    """The transformer in its training form, streamed from the checkpoint onto `device` (None = the CPU, from
    where DeepSpeed or the model-parallel split places it); offloaded blocks' weights stay in host memory."""
    p = cfg.project
    torch.manual_seed(p.train.seed)  # same LoRA init on every rank
    t = p.train
    dtype = getattr(torch, cfg.precision)
    share = run_plan.offload_share(p.model.path, p.lora, t.offload_blocks if t.mode == "lora" else 0,
                                 t.fp8_base and t.mode == "lora", dtype.itemsize)
    where = training_device(device)
    kernel = kept_attention.choose_kernel(t.attention_kernel, where)
    if where.type == "cuda":  # where there is a choice (a CPU runs its one SDPA kernel): say which one runs
        print0(f"attention kernel: {kernel} (train.attention_kernel {t.attention_kernel})",
               rank=int(os.environ.get("RANK", "0")))
    try:
        transformer, offloader = prepare.load_for_training(
            p.model.path, dtype, device or torch.device("cpu"), t.mode, p.lora,
            t.gradient_checkpointing, t.compile, t.fp8_base, t.checkpoint_blocks, t.fp8_transposed, t.offload_blocks,
            share, t.kept_attention_blocks, fp8_fast_accum=t.fp8_fast_accum, attention=t.attention)
    except torch.cuda.OutOfMemoryError as e:
        raise out_of_memory(e, "loading the transformer", "load", cfg.micro_batch_size) from e
    frozen = prepare.freeze_unreached(transformer) if t.deepcompile else 0  # its ZeRO-1/2 pass needs a gradient
    if frozen:  # for every trainable weight it compiles
        print0(f"DeepCompile: {frozen} trainable weights of the last block frozen, which no output reaches",
               rank=int(os.environ.get("RANK", "0")))
    if offloader is not None:
        print0(f"offloaded blocks: {len(offloader.blocks)} blocks' frozen weights in host memory "
               f"({offloader.host_bytes / 1e9:.1f} GB pinned{', one copy for the node' if offloader.shared else ''}), "
               f"{offloader.device_bytes / 1e9:.2f} GB of device slots",
               rank=int(os.environ.get("RANK", "0")))
    if p.train.fp8_base:
        linears = [m for m in transformer.modules() if isinstance(m, fp8.Float8FrozenLinear)]
        fast = sum(m.fast_accum for m in linears)
        print0(f"fp8 base: {len(linears)} frozen linears kept in float8 e4m3"
               f"{f', {fast} of them with fast accumulation (train.fp8_fast_accum)' if fast else ''}",
               rank=int(os.environ.get("RANK", "0")))
    if p.train.mode == "lora" and p.lora.init_from:
        report = lora_io.load_into(transformer, p.lora.init_from, adapter_name="default")
        print0(f"{report} from {p.lora.init_from}", rank=int(os.environ.get("RANK", "0")))
    return transformer


def training_device(device: torch.device | None) -> torch.device:
    """Where the transformer trains: `device`, or for the model-parallel split (which builds on the CPU) the first
    GPU, or the CPU without one."""
    if device is not None:
        return device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def build_source(cfg: config.Config, d: engine.Dist, variant: str, rows: list[pairs.Row],
                 loader) -> sources.LoaderSource:
    """Encoded micro-batches: from the cache (data.cache != "off"; no encoder is loaded) or encoded online (one
    micro-batch ahead with data.encode_ahead)."""
    if cfg.project.data.cache != "off":
        return cache_reader.cached_source(cfg, d, variant, rows, loader.dataset)
    p = cfg.project
    dtype = loading.encoder_dtype(p.model.encoder_dtype, d.device)
    encoders = family.variant_family(variant).load_encoders(p.model.path, dtype, d.device,
                                                            vae_2d_frames=p.model.vae_2d_frames)
    if p.data.encode_ahead:  # resolved by load_config: never in the model-parallel mode
        print0("online encoding: one micro-batch ahead of the step, in a thread (data.encode_ahead)", rank=d.rank)
    return sources.online_source(loader, encoders, variant, p.data.encode_ahead)


def export_weights(cfg: config.Config, module, out_dir: Path, variant: str, step: int) -> Path:
    """The trained weights as a diffusers LoRA file or transformer directory, with their metadata."""
    p = cfg.project
    metadata = exports.export_metadata(config.to_dict(cfg), variant, step)
    if p.train.mode == "lora":
        return exports.export_lora(module, out_dir, p.lora.alpha, p.lora.rank, metadata,
                                   keys=family.variant_family(variant).lora)
    return exports.export_full(module, out_dir, metadata)


def write_summary(out_dir: str, summary: dict) -> None:
    import json

    (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def resume_point(out_dir: str, d: engine.Dist, resume: str | None) -> tuple[str | None, int, dict]:
    """(tag, step, trainer_state) to resume from in `out_dir` (output.dir), checked before any model loads;
    (None, 0, {}) for a fresh run."""
    if resume is None:
        return None, 0, {}
    tag, state = checkpoint.resolve_tag(out_dir, resume)
    checkpoint.check_world_size(state, d.world_size, tag)
    return tag, state["step"], state


def resume_engine(cfg: config.Config, d: engine.Dist, eng, tag: str, state: dict, changes: dict) -> None:
    """Load checkpoint `tag` (its trainer_state `state`) into `eng`. A resume that re-stretches the LR schedule
    says so in a warning with both rates and records the new max_steps among `changes` (config_changes.jsonl)."""
    p = cfg.project
    checkpoint.load(eng, p.output.dir, tag)
    print0(f"resumed from {tag} (step {state['step']})", rank=d.rank)
    note = resume_changes.schedule_note(state, p.train.max_steps, state["step"], eng.lr_scheduler)
    if note:
        print0(note, rank=d.rank)
        changes["qwen_edit.train.max_steps"] = [resume_changes.saved_max_steps(state), p.train.max_steps]


def start_writing(cfg: config.Config, d: engine.Dist, overwrite: bool, start_step: int,
                  changes: dict | None = None) -> None:
    """Every check has passed and everything is built: the run's first writes into its output directory.
    `changes`: settings that differ from the resumed checkpoint's, appended to OUTPUT/config_changes.jsonl."""
    out = cfg.project.output.dir
    if outdir.is_holder(cfg.deepspeed, d):
        outdir.start_writing(out, overwrite)
    if d.is_main:
        config.write_resolved(cfg, out)
        Metrics.truncate(out, start_step)  # drop records of steps that will be trained again
        if changes:
            print0("resumed with changed settings: " + "; ".join(f"{k}: {json.dumps(old)} -> {json.dumps(new)}"
                                                                 for k, (old, new) in changes.items()))
            with open(Path(out) / "config_changes.jsonl", "a") as f:
                f.write(json.dumps({"step": start_step, "changes": changes}) + "\n")


def with_family_defaults(cfg: config.Config, fam: ModelFamily) -> config.Config:
    """`cfg` with the settings whose default is the model family's filled in (qwen_edit.lora.target_modules: null =
    the family's default targets): once, by the command, before anything reads them or the resolved config is
    written."""
    lora = cfg.project.lora
    if lora.target_modules is not None:
        return cfg
    lora = dataclasses.replace(lora, target_modules=list(fam.lora.targets))
    return dataclasses.replace(cfg, project=dataclasses.replace(cfg.project, lora=lora))


def run(cfg: config.Config, d: engine.Dist, resume: str | None = None, overwrite: bool = False) -> None:
    p = cfg.project
    fam, variant = family.detect(p.model.path, p.model.variant)
    tag, start_step, saved = resume_point(p.output.dir, d, resume)
    rows, loader = build_data(cfg, d, variant)
    where = "CPU processes: torch sees no GPU" if d.device.type == "cpu" else "one GPU per process"
    print0(f"{len(rows)} rows, variant {variant} ({fam.variant(variant).title}), world size {d.world_size} ({where}), "
           f"precision {cfg.precision}", rank=d.rank)
    planned = run_plan.plan_run(cfg, d, variant, loader.dataset)  # before the config is resolved and written
    resolved = config.to_dict(cfg)
    changes = resume_changes.config_changes(saved, resolved, tag) if tag else {}  # the planned settings included
    data = fingerprint(rows)
    changed_data = resume_changes.data_change(saved, data, tag, start_step) if tag else None
    if changed_data:
        print0(changed_data, rank=d.rank)
        changes["data rows"] = [saved["data"], data]
    source = build_source(cfg, d, variant, rows, loader)
    conditioning = replay.record_before_training(cfg, d)  # from the cache: encoders leave before the model
    transformer = build_transformer(cfg, d.device)
    eng, _ = engine.build_engine(transformer, cfg.deepspeed)
    if tag is not None:
        resume_engine(cfg, d, eng, tag, saved, changes)
    diskspace.check(eng, d, p.output, p.train.max_steps, start_step,
                    exports.export_bytes(eng.module, p.train.mode), overwrite)  # before the directory is written
    start_writing(cfg, d, overwrite, start_step, changes)
    trainer_state = {"world_size": d.world_size, "micro_batch_size": cfg.micro_batch_size, "variant": variant,
                     "gradient_accumulation_steps": cfg.deepspeed["gradient_accumulation_steps"], "config": resolved,
                     "data": data}
    monitor = gpumon.start_monitor(p.output.dir, p.output.gpu_monitor_interval_s, d.local_rank, gpumon.node_rank())
    metrics = (Metrics(p.output.dir, p.train.max_steps, start_step, p.output.tensorboard, monitor) if d.is_main
               else NullMetrics())
    try:
        encoders = getattr(source, "encoders", None) if conditioning is None else replay.vae_only(p.model, d)
        hook = validation.build_hook(cfg, d, eng.module, encoders, metrics, start_step, conditioning,
                                     getattr(source, "encoders_lock", None))

        def after_step(step: int) -> None:
            if hook is not None:
                hook(step)
            # rank 0 alone exports: ZeRO-1/2 keep whole weights on every rank
            if d.is_main and loop.should_export(step, p.output, p.train.max_steps):
                path = export_weights(cfg, eng.module, Path(p.output.dir) / "export" / f"step_{step:06d}", variant,
                                      step)
                metrics.message(f"exported {path}")

        watch = preempt.Watch()
        timer = steptime.StepTimer(d.device)
        steps = loop.train(cfg, d, eng, source, loading.scheduler_config(p.model.path), metrics, trainer_state,
                           start_step, after_step=after_step, watch=watch, timer=timer)
    finally:
        metrics.close()
        gpus = monitor.stop()
        if d.is_main:
            write_loss_curve(p.output.dir)
    finish(cfg, d, eng, variant, steps, {"gpus": gpus, "memory_plan": planned,
                                         "step_time": step_times(cfg, timer, start_step, d.world_size, d.rank)},
           hook)


def step_times(cfg: config.Config, timer: steptime.StepTimer, start_step: int, world_size: int,
               rank: int) -> dict | None:
    """summary.json's step_time: steptime.step_time_stats of this process's steps (the `world_size` data-parallel
    replicas step together), printed as the end-of-run line if `rank` is 0."""
    samples = cfg.micro_batch_size * cfg.deepspeed["gradient_accumulation_steps"] * world_size
    seconds = timer.seconds()
    stats = steptime.step_time_stats(seconds, samples, first_step=start_step + 1)
    print0(steptime.describe(stats, len(seconds)), rank=rank)
    return stats


def finish(cfg: config.Config, d: engine.Dist, eng, variant: str, steps: int, record: dict,
           hook: validation.Validator | None) -> None:
    """After the last step, on every rank (collectives): the ranks' weights compared, summary.json
    (`record`'s GPU summaries, memory plan and step times, the largest validation render's measured peak) and the
    export."""
    p = cfg.project
    gpus = gpumon.gather_summaries(record["gpus"])
    render_peak = validation.render_peak_gb(hook)
    digests = loop.replica_digests(eng.module)
    if len(set(digests)) != 1:
        raise RuntimeError(f"trainable weights differ between ranks after training: {digests}")
    planned = record["memory_plan"]
    if render_peak is not None:
        predicted = (planned or {}).get("predicted_render_peak_gb")
        print0(f"validation: renders peaked at {render_peak:.2f} GB of GPU memory (the largest of every rank's)"
               + (f"; the memory plan predicted {predicted:.2f} GB" if predicted is not None else ""), rank=d.rank)
    if d.is_main:
        write_summary(p.output.dir, {"steps": steps, "world_size": d.world_size, "variant": variant,
                                     "replica_digests": digests, "gpus": gpus, "memory_plan": planned,
                                     "step_time": record["step_time"], "measured_render_peak_gb": render_peak})
        path = export_weights(cfg, eng.module, Path(p.output.dir) / "export", variant, steps)
        print0(f"exported {path}", rank=d.rank)
    engine.barrier()
