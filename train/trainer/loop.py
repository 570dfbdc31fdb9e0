"""The training loop: encode, noise, predict, step; cadence decisions in small helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from train.config import Config, OutputConfig, TrainConfig
from train.data.sources import Batch
from train.model import family
from train.model.interface import ModelFamily
from train.plan.keys import configured_offload
from train.runtime import checkpoint, faults, oom, preempt
from train.runtime.collector import Collector
from train.runtime.engine import Dist, all_gather_objects
from train.runtime.probes import (
    GcWindow,
    alloc_retries,
    compiled_graphs,
    host_pinned_gb,
    host_rss_gb,
    peak_memory_gb,
    peak_reserved_gb,
)
from train.runtime.record import Throughput
from train.runtime.steptime import StepTimer
from train.trainer import objective


def noisy_inputs(b: Batch, t: TrainConfig, generator: torch.Generator, scheduler_cfg: dict, dtype: torch.dtype,
                 fam: ModelFamily):
    """(transformer kwargs, noise, sigmas) of one micro-batch, the kwargs as `fam` (the model's family) feeds its
    transformer; the draws from `generator` are in a fixed order, so any stage that holds the batch and the
    generator rebuilds the same inputs (model_parallel's cut)."""
    batch_size, num_tokens = b.x0.shape[:2]
    shift = t.shift or objective.dynamic_shift(num_tokens, scheduler_cfg)
    sigmas = objective.sample_sigmas(batch_size, t.timestep_density, generator, shift, t.logit_mean, t.logit_std)
    noise = torch.randn(b.x0.shape, generator=generator, device=b.x0.device, dtype=b.x0.dtype)
    x_t = objective.noisy_input(b.x0, noise, sigmas)
    return fam.transformer_inputs(b, x_t, sigmas, dtype), noise, sigmas


def forward_loss(model, b: Batch, t: TrainConfig, generator: torch.Generator, scheduler_cfg: dict,
                 dtype: torch.dtype, fam: ModelFamily) -> torch.Tensor:
    """Flow-matching loss of one micro-batch through `model` (the engine or the bare transformer of family
    `fam`), on the target's tokens."""
    kwargs, noise, sigmas = noisy_inputs(b, t, generator, scheduler_cfg, dtype, fam)
    pred = fam.target_prediction(model(**kwargs), b)
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


def oom_message(step: int, b: Batch, mode: str, pixels_per_latent: int, now: oom.InEffect | None = None,
                figures: str = "") -> str:
    h, w = (side * pixels_per_latent for side in b.target_hw)
    return (
        f"CUDA out of memory at step {step + 1}: micro-batch {b.x0.shape[0]}, target {w}x{h} px "
        f"({b.x0.shape[1]} tokens) + {b.cond.num_reference_tokens} reference tokens, mode "
        f"{mode}{figures}. {oom.oom_advice('step', b.x0.shape[0], now)}"
    )


def in_effect(cfg: Config, device: torch.device) -> oom.InEffect:
    """The memory settings this run trains with (the plan's, applied to the config), for the OOM advice; the plan
    runs only on a GPU."""
    p = cfg.project
    t = p.train
    planned = p.memory.plan == "auto" and device.type == "cuda"
    return oom.InEffect(t.gradient_checkpointing and t.checkpoint_blocks == 0, t.offload_blocks, t.fp8_base,
                        bool(configured_offload(cfg.deepspeed)), planned, p.memory.margin_gb)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps with a NaN/inf loss or gradient norm: a stop the trainer decides itself, on every
    rank at the same step (DeepSpeed's overflow check is global); its message says what to do."""

    without_traceback = True  # engine.exit_with prints the message alone wherever no command catches it


def start_position(start_step: int, gas: int, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch, micro-batches already taken from it) after `start_step` optimizer steps."""
    return divmod(start_step * gas, batches_per_epoch)


def _engine_loss(engine, t: TrainConfig, scheduler_cfg: dict, dtype: torch.dtype,
                 fam: ModelFamily) -> faults.StepLoss:
    """loss_of(step, batch, generator): forward_loss through the engine. `step` (1-based) is what
    faults.FaultPlan.around_loss keys on when a run injects faults; the plain loss does not need it."""

    def loss_of(step: int, b: Batch, generator: torch.Generator) -> torch.Tensor:
        return forward_loss(engine, b, t, generator, scheduler_cfg, dtype, fam)

    return loss_of


def _backward(engine, loss_of: faults.StepLoss, b: Batch, generator: torch.Generator, step: int,
              mode: str, pixels_per_latent: int, now: oom.InEffect | None = None) -> torch.Tensor:
    """Loss and backward of one micro-batch of optimizer step `step` + 1 (`step` steps are done); a CUDA OOM
    becomes oom.OutOfMemory naming the micro-batch, torch's figures and the settings that help (`now`: those
    in effect, left out of the advice)."""
    try:
        loss = loss_of(step + 1, b, generator)
        engine.backward(loss)
    except torch.cuda.OutOfMemoryError as e:
        raise oom.OutOfMemory(oom_message(step, b, mode, pixels_per_latent, now, oom.torch_oom_figures(e))) from e
    return loss


class _Window:
    """What the next log record reports: the losses of the optimizer steps applied since the last record (summed
    on the device, no sync per step), their samples and tokens; and the run's count of skipped steps."""

    def __init__(self, device: torch.device, start_step: int, gas: int, max_nonfinite_steps: int):
        self.loss = torch.zeros((), device=device)  # sum over the applied steps of the window
        self.step_loss = torch.zeros((), device=device)  # the optimizer step in progress
        self.num_steps, self.skipped, self.last_logged = 0, 0, start_step
        self.gas, self.max_nonfinite_steps = gas, max_nonfinite_steps
        self.speed = Throughput()
        self.gc = GcWindow()

    def add(self, loss: torch.Tensor, b: Batch, world_size: int) -> None:
        """One micro-batch of this rank (the world trains `world_size` of them at once)."""
        self.step_loss += loss.detach() / self.gas
        tokens = b.x0.shape[1] + b.cond.num_reference_tokens + b.cond.num_text_tokens
        self.speed.add(b.x0.shape[0] * world_size, b.x0.shape[0] * tokens * world_size)

    def end_step(self, step: int, applied: bool, metrics) -> None:
        """Optimizer step `step` is done (`applied`: DeepSpeed updated the weights); too many skipped steps raise
        NonFiniteError."""
        if applied:
            self.loss += self.step_loss
            self.num_steps += 1
        else:  # DeepSpeed found a NaN/inf gradient norm and skipped the update
            self.skipped += 1
            metrics.message(f"warning: step {step} skipped: non-finite loss or gradient norm "
                            f"({self.skipped} of at most {self.max_nonfinite_steps})")
            if self.skipped > self.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.skipped} optimizer steps had a NaN/inf loss or gradient norm (last at step {step}); "
                    "stopping. Lower the learning rate, check the data, or raise "
                    "qwen_edit.train.max_nonfinite_steps"
                )
        self.step_loss.zero_()

    def record(self, step: int, epoch: int, variant: str, engine, source, d: Dist) -> dict:
        """The log record of `step` (a collective: every rank calls it), then a new window from `step`."""
        elapsed = self.speed.elapsed()
        record = {"step": step, "epoch": epoch, "variant": variant,
                  "loss": _mean_over_ranks(self.loss / self.num_steps, d.group),
                  "lr": engine.get_lr()[0], "grad_norm": _grad_norm(engine), "skipped_steps": self.skipped,
                  "data_wait_fraction": source.take_wait_s() / elapsed,
                  **self.speed.read(step - self.last_logged), "peak_memory_gb": peak_memory_gb(d.device),
                  "peak_reserved_gb": peak_reserved_gb(d.device), "alloc_retries": alloc_retries(d.device),
                  "compiled_graphs": compiled_graphs(), "gc_s": self.gc.take(),
                  "host_rss_gb": host_rss_gb(), "host_pinned_gb": host_pinned_gb(d.device)}
        self.loss.zero_()
        self.num_steps, self.last_logged = 0, step
        return record


def save_when_due(engine, step: int, max_steps: int, out: OutputConfig, trainer_state: dict, watch,
                   d: Dist) -> None:
    """The checkpoint of the save cadence; on a preemption request (`watch`, a collective) every rank saves the
    step just finished, if the cadence did not, and raises preempt.Preempted."""
    due = should_save(step, out, max_steps)
    if due:
        checkpoint.save(engine, out.dir, step, trainer_state, out.keep_last)
    if watch is not None and watch.requested(d.device):
        if not due:
            checkpoint.save(engine, out.dir, step, trainer_state, out.keep_last)
        raise preempt.Preempted(step)


def train(cfg: Config, d: Dist, engine, source, scheduler_cfg: dict, metrics, trainer_state: dict,
          start_step: int = 0, after_step: Callable[[int], None] | None = None, watch=None,
          timer: StepTimer | None = None) -> int:
    """Run optimizer steps start_step+1 .. train.max_steps; checkpoints at the cadence and at the end.

    `source` yields encoded micro-batches (see LoaderSource); `after_step(step)` runs after every optimizer
    step, its log and its save (validation hooks in here). `watch` (a preempt.Watch): on SIGTERM every rank saves
    the step just finished and raises preempt.Preempted. `timer` gets each step's time, the work between steps
    (log records, saves, `after_step`) left out. The garbage collector runs as train.gc_every_steps says.
    """
    t, out = cfg.project.train, cfg.project.output
    gas = cfg.deepspeed["gradient_accumulation_steps"]
    # the fault-injection variables are read here, once; their hooks wrap the loss only when a fault is requested
    fam = family.variant_family(trainer_state["variant"])
    loss_of = faults.FaultPlan.from_env().around_loss(
        _engine_loss(engine, t, scheduler_cfg, getattr(torch, cfg.precision), fam))
    epoch, taken = start_position(start_step, gas, len(source))  # resume inside the epoch where it stopped
    step, micro = start_step, 0
    window = _Window(d.device, start_step, gas, t.max_nonfinite_steps)
    timer = timer or StepTimer(d.device)
    now = in_effect(cfg, d.device)
    engine.train()
    source.take_wait_s()
    with Collector(t.gc_every_steps, start_step) as collector:
        timer.start()
        while step < t.max_steps:
            source.start_epoch(epoch, taken)
            taken = 0
            for batch in source:
                generator = micro_batch_generator(t.seed, step, micro, gas, d, d.device)
                loss = _backward(engine, loss_of, batch, generator, step, t.mode, fam.pixels_per_latent, now)
                engine.step()
                window.add(loss, batch, d.world_size)
                micro += 1
                if micro < gas:
                    continue
                step, micro = step + 1, 0
                metrics.step()
                window.end_step(step, engine.was_step_applied(), metrics)
                collector.after_step(step, should_log(step, out, t.max_steps))
                timer.stop()
                if should_log(step, out, t.max_steps) and window.num_steps:
                    metrics.log(window.record(step, epoch, trainer_state["variant"], engine, source, d))
                with window.speed.excluded(), collector.automatic():  # saves and renders are not step time
                    save_when_due(engine, step, t.max_steps, out, trainer_state, watch, d)
                    if after_step is not None:
                        after_step(step)
                metrics.unpause()
                if step >= t.max_steps:
                    break
                timer.start()
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
