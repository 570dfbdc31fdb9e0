"""The training loop: encode, noise, predict, step; cadence decisions in small helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from train.config import Config, OutputConfig, TrainConfig
from train.data.sources import Batch
from train.model import conditioning, memory
from train.runtime import checkpoint, faults, preempt
from train.runtime.engine import Dist, all_gather_objects
from train.runtime.metrics import Throughput, peak_memory_gb
from train.trainer import objective


def noisy_inputs(b: Batch, t: TrainConfig, generator: torch.Generator, scheduler_cfg: dict, dtype: torch.dtype):
    """(transformer kwargs, noise, sigmas) of one micro-batch; the draws from `generator` are in a fixed order,
    so any stage that holds the batch and the generator rebuilds the same inputs (model_parallel's cut)."""
    batch_size, num_tokens = b.x0.shape[:2]
    shift = t.shift or objective.dynamic_shift(num_tokens, scheduler_cfg)
    sigmas = objective.sample_sigmas(batch_size, t.timestep_density, generator, shift, t.logit_mean, t.logit_std)
    noise = torch.randn(b.x0.shape, generator=generator, device=b.x0.device, dtype=b.x0.dtype)
    x_t = objective.noisy_input(b.x0, noise, sigmas)
    kwargs = dict(
        hidden_states=torch.cat([x_t, b.cond.reference_tokens.float()], dim=1).to(dtype),
        timestep=sigmas.to(dtype),
        encoder_hidden_states=b.cond.prompt_embeds.to(dtype),
        encoder_hidden_states_mask=b.cond.prompt_mask,
        img_shapes=conditioning.img_shapes(b.target_hw, b.cond.reference_shapes, batch_size),
        return_dict=False,
    )
    return kwargs, noise, sigmas


def forward_loss(model, b: Batch, t: TrainConfig, generator: torch.Generator, scheduler_cfg: dict,
                 dtype: torch.dtype) -> torch.Tensor:
    """Flow-matching loss of one micro-batch through `model` (the engine or the bare transformer)."""
    kwargs, noise, sigmas = noisy_inputs(b, t, generator, scheduler_cfg, dtype)
    pred = model(**kwargs)[0]
    weights = objective.loss_weights(sigmas, t.loss_weighting)
    return objective.flow_loss(pred, objective.velocity_target(b.x0, noise), weights)


def micro_batch_generator(seed: int, step: int, micro_step: int, gas: int, d: Dist, device) -> torch.Generator:
    """Noise and timesteps for one micro-batch, seeded by its global slot (step, accumulation index `micro_step`
    of the `gas` gradient-accumulation steps, rank).

    Slot k of optimizer step n is the same sample position whether it runs as rank k of a data-parallel
    world or as accumulation step k of one process, so 2 ranks x GAS 1 and 1 rank x GAS 2 draw the same
    noise for the same samples, and a resumed run needs no generator state.
    """
    slot = (step * gas + micro_step) * d.world_size + d.rank
    return torch.Generator(device).manual_seed(seed * 1_000_003 + slot)


def should_log(step: int, out: OutputConfig, max_steps: int) -> bool:
    return step % out.log_every_steps == 0 or step == max_steps


def should_save(step: int, out: OutputConfig, max_steps: int) -> bool:
    """An intermediate checkpoint (output.save_every_steps); the last step always gets the final save."""
    every = out.save_every_steps
    return bool(every) and step % every == 0 and step != max_steps


def should_export(step: int, out: OutputConfig, max_steps: int) -> bool:
    """An intermediate export (output.export_every_steps); the last step always gets the final export."""
    every = out.export_every_steps
    return bool(every) and step % every == 0 and step != max_steps


def _mean_over_ranks(value: torch.Tensor, group=None) -> float:
    """Mean over the data-parallel replicas (`group`; None = every rank)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value = value / dist.get_world_size(group)
    return value.item()  # sync point: only at log cadence


def oom_message(step: int, b: Batch, mode: str) -> str:
    h, w = b.target_hw
    return (
        f"CUDA out of memory at step {step + 1}: micro-batch {b.x0.shape[0]}, target {w * 8}x{h * 8} px "
        f"({b.x0.shape[1]} tokens) + {b.cond.reference_tokens.shape[1]} reference tokens, mode "
        f"{mode}. {memory.oom_advice('step', b.x0.shape[0])}"
    )


class NonFiniteError(RuntimeError):
    """Too many optimizer steps with a NaN/inf loss or gradient norm."""


def start_position(start_step: int, gas: int, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch, micro-batches already taken from it) after `start_step` optimizer steps."""
    return divmod(start_step * gas, batches_per_epoch)


def train(cfg: Config, d: Dist, engine, source, scheduler_cfg: dict, metrics, trainer_state: dict,
          start_step: int = 0, after_step: Callable[[int], None] | None = None, watch=None) -> int:
    """Run optimizer steps start_step+1 .. train.max_steps; checkpoints at the cadence and at the end.

    `source` yields encoded micro-batches (see LoaderSource); `after_step(step)` runs after every optimizer
    step, its log and its save (validation hooks in here). `watch` (a preempt.Watch): on SIGTERM every rank saves
    the step just finished and raises preempt.Preempted.
    """
    t, out = cfg.project.train, cfg.project.output
    dtype = getattr(torch, cfg.precision)
    gas = cfg.deepspeed["gradient_accumulation_steps"]
    epoch, taken = start_position(start_step, gas, len(source))  # resume inside the epoch where it stopped
    step, last_logged, micro, skipped = start_step, start_step, 0, 0
    window_loss, window_steps = torch.zeros((), device=d.device), 0
    step_loss = torch.zeros((), device=d.device)
    speed = Throughput()
    engine.train()
    source.take_wait_s()
    while step < t.max_steps:
        source.start_epoch(epoch, taken)
        taken = 0
        for batch in source:
            generator = micro_batch_generator(t.seed, step, micro, gas, d, d.device)
            try:
                faults.maybe_oom(step + 1)
                loss = faults.maybe_poison_loss(forward_loss(engine, batch, t, generator, scheduler_cfg, dtype),
                                                step + 1)
                engine.backward(loss)
            except torch.cuda.OutOfMemoryError as e:
                raise memory.OutOfMemory(oom_message(step, batch, t.mode)) from e
            engine.step()
            step_loss += loss.detach() / gas
            micro += 1
            tokens = batch.x0.shape[1] + batch.cond.reference_tokens.shape[1] + batch.cond.prompt_embeds.shape[1]
            speed.add(batch.x0.shape[0] * d.world_size, batch.x0.shape[0] * tokens * d.world_size)
            if micro < gas:
                continue
            step, micro = step + 1, 0
            metrics.step()
            if engine.was_step_applied():
                window_loss += step_loss
                window_steps += 1
            else:  # DeepSpeed found a NaN/inf gradient norm and skipped the update
                skipped += 1
                metrics.message(f"warning: step {step} skipped: non-finite loss or gradient norm "
                                f"({skipped} of at most {t.max_nonfinite_steps})")
                if skipped > t.max_nonfinite_steps:
                    raise NonFiniteError(
                        f"{skipped} optimizer steps had a NaN/inf loss or gradient norm (last at step {step}); "
                        "stopping. Lower the learning rate, check the data, or raise "
                        "qwen_edit.train.max_nonfinite_steps"
                    )
            step_loss.zero_()
            if should_log(step, out, t.max_steps) and window_steps:
                elapsed = speed.elapsed()
                record = {"step": step, "epoch": epoch, "variant": trainer_state["variant"],
                          "loss": _mean_over_ranks(window_loss / window_steps, d.group),
                          "lr": engine.get_lr()[0], "grad_norm": _grad_norm(engine), "skipped_steps": skipped,
                          "data_wait_fraction": source.take_wait_s() / elapsed,
                          **speed.read(step - last_logged), "peak_memory_gb": peak_memory_gb(d.device)}
                metrics.log(record)
                window_loss.zero_()
                window_steps, last_logged = 0, step
            if should_save(step, out, t.max_steps):
                checkpoint.save(engine, out.dir, step, trainer_state, out.keep_last)
            if watch is not None and watch.requested(d.device, d.group):
                if not should_save(step, out, t.max_steps):
                    checkpoint.save(engine, out.dir, step, trainer_state, out.keep_last)
                raise preempt.Preempted(step)
            if after_step is not None:
                after_step(step)
            if step >= t.max_steps:
                break
        epoch += 1
    checkpoint.save(engine, out.dir, step, trainer_state, out.keep_last)
    return step


def replica_digests(module: torch.nn.Module, group=None) -> list[str]:
    """sha256 of every rank's trainable weights (a collective over `group`, None = every rank); data-parallel
    replicas must all agree."""
    import hashlib

    h = hashlib.sha256()
    for name, p in module.named_parameters():
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return all_gather_objects(h.hexdigest(), group)


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)
