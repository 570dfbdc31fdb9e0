"""Entry of the model-parallel mode: place this process, build its stage, run it, tear down.

The decoder stages reuse the ZeRO-2 mode's pieces unchanged (train.trainer.build's builders, loop.train, checkpoint,
exports): only their source of micro-batches differs (stages.ReceivingSource instead of the loader + encoders).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from model_parallel import pipeline, stages, transport, worlds
from model_parallel import plan as placement
from model_parallel import validation as mp_validation
from train import config
from train.data import pairs
from train.model import family, loading, lora_io
from train.runtime import checkpoint, diskspace, engine, exports, outdir, preempt, resume_changes, steptime
from train.runtime.console import print0
from train.runtime.plot import write_loss_curve
from train.runtime.record import Metrics, NullMetrics
from train.trainer import build, loop


def num_blocks(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "transformer" / "config.json").read_text())["num_layers"]


def build_plan(cfg: config.Config) -> placement.Plan:
    env = os.environ
    par = cfg.project.parallel
    local = int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))
    return placement.build_plan(par.stages, par.decoder_cuts, int(env.get("WORLD_SIZE", "1")),
                                num_blocks(cfg.project.model.path), torch.cuda.device_count(), local)


def parallel_layout(par: config.ParallelConfig, world_size: int) -> dict:
    return {"mode": par.mode, "world_size": world_size, "stages": len(par.stages), "decoder_cuts": par.decoder_cuts}


def resume_point(cfg: config.Config, world_size: int, resume: str | None) -> tuple[str | None, dict, dict]:
    """(tag, its trainer_state, changed settings) to resume from; the checkpoint must come from the same placement
    (ZeRO shards are per rank)."""
    if resume is None:
        return None, {"step": 0}, {}
    tag, state = checkpoint.resolve_tag(cfg.project.output.dir, resume)
    checkpoint.check_world_size(state, world_size, tag)
    saved, now = state.get("parallel"), parallel_layout(cfg.project.parallel, world_size)
    if saved != now:
        raise checkpoint.ResumeError(f"--resume {tag}: saved with placement {saved}, resumed with {now}; resume with "
                                     "the same qwen_edit.parallel settings, or export and start anew "
                                     "(see docs/checkpoints.md)")
    return tag, state, resume_changes.config_changes(state, config.to_dict(cfg), tag)


def run_encoder(cfg: config.Config, d: engine.Dist, links: worlds.Links, watch: preempt.Watch) -> bool:
    """Feed this pipeline's decoder; returns whether a preemption stopped the run (then after its checkpoint)."""
    p = cfg.project
    _, variant = family.detect(p.model.path, p.model.variant)
    try:
        rows, loader = build.build_data(cfg, d, variant)
    except pairs.BadRowsError as e:  # tell the decoder, so that it stops with the same message
        sender = transport.Sender(links.to_next, 1)
        sender.send({"kind": "error", "message": str(e)})
        sender.flush()
        raise
    source = build.build_source(cfg, d, variant, rows, loader)  # the frozen encoders (or the cache)
    stats = stages.run_encoder(cfg, source, links.to_next, peer=1, opening=lambda: mp_validation.encoder_opening(
        cfg, d, getattr(source, "encoders", None)), watch=watch)
    peak = (f", peak memory {torch.cuda.max_memory_allocated(d.device) / 1e9:.2f} GB (torch max allocated)"
            if d.device.type == "cuda" else "")
    print0(f"encoder stage: {stats['micro_batches']} micro-batches, busy {stats['busy_s']:.1f} s, "
           f"idle {stats['idle_s']:.1f} s{peak}", rank=d.rank)
    if stats["stopped"]:
        watch.wait_saved(p.parallel.collective_timeout_s)
    return stats["stopped"]


def build_stage(cfg: config.Config, plan: placement.Plan, me: placement.Placement, d: engine.Dist):
    """(engine, the module whose weights are exported, data-parallel view of this process) for a decoder stage.

    One decoder stage trains the plain transformer exactly as the ZeRO-2 mode does (same checkpoint layout);
    a cut wraps this stage's blocks in split.DecoderStage and gives DeepSpeed the stage/replica groups.
    """
    transformer = build.build_transformer(cfg)
    if plan.num_stages == 2:
        eng, _ = engine.build_engine(transformer, cfg.deepspeed)
        return eng, transformer, d
    from model_parallel.split import DecoderStage

    mpu = worlds.ModelParallelGroups(plan, me)
    stage = DecoderStage(transformer, me.blocks, me.is_first_decoder, me.is_last_decoder)
    for param in stage.parameters():
        param.model_parallel = True  # DeepSpeed: each stage's own weights count in the summed gradient norm
    eng, _ = engine.build_engine(stage, cfg.deepspeed, mpu)
    dp = engine.Dist(me.pipeline, plan.num_pipelines, d.local_rank, d.device, group=mpu.get_data_parallel_group())
    return eng, transformer, dp


def _open_cut(gas: int, me: placement.Placement, links: worlds.Links) -> tuple[int, transport.Sender | None]:
    """(micro-batches per epoch, the sender to the next stage or None): the encoder's opening message (its bad rows
    stop this stage with the same message); a stage before the last passes the epoch length on along the cut."""
    try:
        batches_per_epoch = stages.receive_start(links.to_prev, 0)
    except stages.EncoderStopped as e:
        raise pairs.BadRowsError(str(e)) from e
    if me.is_last_decoder:
        return batches_per_epoch, None
    sender = transport.Sender(links.to_next, 1, max_in_flight=gas + 1)  # a step's micro-batches and one more
    sender.send({"kind": "start", "batches_per_epoch": batches_per_epoch})
    return batches_per_epoch, sender


def _receiving_source(cfg: config.Config, me: placement.Placement, links: worlds.Links, module: torch.nn.Module,
                      device: torch.device, batches_per_epoch: int, start_step: int, join):
    """(micro-batches from the previous stage, validation conditioning or None, gradient converter or None).
    The first decoder stage receives the conditioning and tells the encoder where to start; a later stage sends
    the gradients of what it received back along the cut. `join`: the family's join_conditioning."""
    p = cfg.project
    if me.is_first_decoder:
        # only the first decoder stage: the config refuses a decoder cut with validation
        conditioning = mp_validation.receive_conditioning(p.validation, links.to_prev, 0)
        stages.send_ready(links.to_prev, 0, start_step)
        convert = None
    else:
        conditioning = None
        convert = pipeline.receiving_converter(module, device, transport.Sender(links.grads_to_prev, 0, 10**6), join)
    source = stages.ReceivingSource(links.to_prev, 0, device, batches_per_epoch,
                                    stages.num_micro_batches(cfg, start_step), p.parallel.queue_depth,
                                    convert or (lambda meta, tensors: transport.message_batch(meta, tensors, device,
                                                                                              join)),
                                    overlap=p.parallel.overlap or not me.is_first_decoder)
    return source, conditioning, convert


def _close_links(source: stages.ReceivingSource, sender: transport.Sender | None, convert) -> dict:
    """Drain the links after the last step (or after a preemption ended the streams early), so that no stage's
    send is left unmatched; returns the encoder's closing statistics."""
    upstream_stats = source.close()
    if sender is not None:
        sender.send(upstream_stats)  # the encoder's closing statistics travel on to the last stage
        sender.flush()
    if convert is not None:
        convert.grad_sender.flush()
    return upstream_stats


def _summary(par: config.ParallelConfig, world_size: int, variant: str, steps: int, digests: list[str], wall: float,
             source: stages.ReceivingSource, upstream_stats: dict, hook, step_time: dict | None) -> dict:
    """summary.json of a model-parallel run: steps, placement, the last stage's waits and step times, the encoder's
    statistics, and the largest validation render's GPU peak on this stage (decoder rank 0; None without renders or a
    GPU)."""
    waited = source.wait_s_total + source.first_wait_s
    render_peak = None if hook is None or hook.peak_bytes is None else hook.peak_bytes / 1e9
    return {"steps": steps, "world_size": world_size, "variant": variant, "replica_digests": digests,
            "measured_render_peak_gb": render_peak, "step_time": step_time,
            "parallel": parallel_layout(par, world_size), "overlap": par.overlap,
            "decoder_wall_s": wall, "decoder_wait_s": waited, "decoder_wait_after_first_s": source.wait_s_total,
            "decoder_busy_fraction": 1 - waited / wall,
            "encoder": {k: v for k, v in upstream_stats.items() if k != "kind"}}


def run_decoder(cfg: config.Config, d: engine.Dist, plan: placement.Plan, me: placement.Placement,
                links: worlds.Links, resume: str | None, watch: preempt.Watch, overwrite: bool = False) -> None:
    """One decoder stage: build it, resume it, train it (the last stage runs loop.train, the others the
    pipeline's upstream schedule), check the replicas agree, then rank 0 writes the summary and the export. On a
    preemption (`watch`) every decoder saves the step it finished, the links are drained and preempt.Preempted
    is raised."""
    p = cfg.project
    world_size = len(plan.placements)
    fam, variant = family.detect(p.model.path, p.model.variant)
    tag, state, changes = resume_point(cfg, world_size, resume)
    start_step = state["step"]
    batches_per_epoch, sender = _open_cut(cfg.deepspeed["gradient_accumulation_steps"], me, links)
    eng, transformer, dp = build_stage(cfg, plan, me, d)
    if tag is not None:
        build.resume_engine(cfg, d, eng, tag, state, changes)
    # room on disk before anything is written: every stage's checkpoint files, and the export that decoder rank 0
    # writes of pipeline 0's stages (a collective of the decoders; OutputDirError on every one of them)
    mine = exports.export_bytes(transformer, p.train.mode) if me.pipeline == 0 else 0
    export_size = sum(engine.all_gather_objects(mine))
    diskspace.check(eng, d, p.output, p.train.max_steps, start_step, export_size, overwrite)
    build.start_writing(cfg, d, overwrite, start_step, changes)
    trainer_state = {"world_size": world_size, "micro_batch_size": cfg.micro_batch_size, "variant": variant,
                     "gradient_accumulation_steps": cfg.deepspeed["gradient_accumulation_steps"],
                     "parallel": parallel_layout(cfg.project.parallel, world_size), "config": config.to_dict(cfg)}
    source, conditioning, convert = _receiving_source(cfg, me, links, eng.module, d.device, batches_per_epoch,
                                                      start_step, fam.join_conditioning)
    scheduler_cfg = loading.scheduler_config(p.model.path)
    metrics = (Metrics(p.output.dir, p.train.max_steps, start_step, p.output.tensorboard) if d.is_main
               else NullMetrics())  # decoder rank 0 is the last stage of pipeline 0
    try:
        hook = mp_validation.decoder_hook(cfg, dp, eng.module, metrics, start_step, conditioning)
        t0 = time.perf_counter()
        timer = steptime.StepTimer(d.device)  # the last stage's steps (decoder rank 0's, for summary.json)
        try:
            if me.is_last_decoder:
                steps = loop.train(cfg, dp, eng, source, scheduler_cfg, metrics, trainer_state, start_step, hook,
                                   watch=watch, timer=timer)
            else:
                steps = pipeline.run_upstream_stage(cfg, dp, eng, eng.module, source, links, sender, scheduler_cfg,
                                                    trainer_state, start_step, fam, watch=watch)
        except preempt.Preempted:
            _close_links(source, sender, convert)
            raise
        wall = time.perf_counter() - t0
    finally:
        metrics.close()
        if d.is_main:
            write_loss_curve(p.output.dir)
    upstream_stats = _close_links(source, sender, convert)
    digests = loop.replica_digests(eng.module, dp.group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"trainable weights differ between decoder replicas after training: {digests}")
    weights = exported_weights(transformer, p.train.mode, plan.num_stages > 2, me)
    if d.is_main:
        step_time = build.step_times(cfg, timer, start_step, dp.world_size, d.rank)
        build.write_summary(p.output.dir, _summary(p.parallel, world_size, variant, steps, digests, wall, source,
                                                        upstream_stats, hook, step_time))
        export(cfg, transformer, weights, exports.export_metadata(config.to_dict(cfg), variant, steps), fam.lora)


def exported_weights(transformer, mode: str, is_cut: bool, me: placement.Placement) -> dict | None:
    """The trained weights for the export: this stage's own, or (over a cut) every stage's of pipeline 0,
    gathered on decoder rank 0 (a collective over the decoder world)."""
    if not is_cut:
        return None
    import torch.distributed as dist

    mine = {}
    if me.pipeline == 0:
        mine = (exports.lora_state_dict(transformer) if mode == "lora"
                else {k: v.detach().cpu() for k, v in transformer.state_dict().items()})
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def export(cfg: config.Config, transformer, weights: dict | None, metadata: dict[str, str], keys) -> None:
    """The run's export (`keys`: the family's LoraKeys)."""
    p = cfg.project
    export_dir = Path(p.output.dir) / "export"
    if p.train.mode == "lora":
        if weights is None:
            path = exports.export_lora(transformer, export_dir, p.lora.alpha, p.lora.rank, metadata, keys=keys)
        else:
            path = exports.write_diffusers_lora(weights, export_dir, p.lora.alpha, p.lora.rank, metadata=metadata,
                                                keys=keys)
    else:
        if weights is not None:  # a whole transformer again, from the base directory and every stage's weights
            transformer = loading.load_transformer(p.model, getattr(torch, cfg.precision))
            transformer.load_state_dict(weights)
        path = exports.export_full(transformer, export_dir, metadata)
    print0(f"exported {path}")


REFUSED_KEY = "decoder/refused"  # set in the launch's store by a decoder that stops with a user error (exit 2)


def _encoder_stage(cfg: config.Config, d: engine.Dist, links: worlds.Links, watch: preempt.Watch) -> int:
    """Run the encoder stage; its exit code. A decoder that refuses the start (a used or unwritable output
    directory, a bad resume point) prints why and exits 2; the encoder's link to it then breaks mid-send, and
    the encoder exits 2 too, without a traceback."""
    try:
        stopped = run_encoder(cfg, d, links, watch)
    except RuntimeError:
        if links.store.check([REFUSED_KEY]):
            return 2
        raise
    return preempt.EXIT_CODE if stopped else 0


def main(cfg: config.Config, resume: str | None, overwrite: bool = False) -> int:
    """Run this process's stage; returns the exit code (0 done, 2 bad data or resume point)."""
    engine.prepare_environment()
    plan = build_plan(cfg)
    me = plan.of(int(os.environ.get("RANK", "0")))
    schedule = "overlapped" if cfg.project.parallel.overlap else "sequential (parallel.overlap false)"
    print0(f"model-parallel placement, {plan.num_pipelines} pipeline(s), {schedule} schedule:\n{plan.describe()}",
           rank=me.rank)
    device = worlds.set_device(me)
    links = worlds.init_worlds(plan, me, cfg.project.parallel.collective_timeout_s)
    d = engine.Dist(me.role_rank, plan.role_world_size(me.is_encoder), int(os.environ.get("LOCAL_RANK", "0")),
                    device)
    watch = preempt.Watch(store=links.store)  # the default group: this process's role world
    code = 0
    try:
        if me.is_encoder:
            code = _encoder_stage(cfg, d, links, watch)
        else:
            import deepspeed

            engine.skip_cpu_shm_op()
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)  # adopts it
            # decoder rank 0 writes the run's files, so it holds the directory (a collective of the decoders)
            with outdir.claim(cfg.project.output.dir, resume is not None, overwrite,
                              outdir.is_holder(cfg.deepspeed, d)):
                run_decoder(cfg, d, plan, me, links, resume, watch, overwrite)
    except preempt.Preempted as e:  # on every decoder, after their save
        watch.saved()
        print0(str(e), rank=d.rank, file=sys.stderr)
        code = preempt.EXIT_CODE
    except (pairs.BadRowsError, checkpoint.ResumeError, lora_io.LoraFileError, outdir.OutputDirError) as e:
        links.store.set(REFUSED_KEY, "1")  # before this process's links close under the encoder
        print0(f"error: {e}", rank=d.rank, file=sys.stderr)  # raised on every decoder: one line
        code = 2
    except checkpoint.SaveError as e:  # perhaps on some ranks only: no collective teardown, the launcher ends the rest
        print(f"error: {e}", file=sys.stderr, flush=True)
        worlds.check_out(links)  # the store's host stops waiting for this process (see worlds.check_out)
        return 1
    engine.teardown()
    worlds.leave(links, cfg.project.parallel.collective_timeout_s)
    return code
