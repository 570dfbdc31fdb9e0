"""The decoder cut: activations forward and their gradients backward between decoder stages (GPipe per step).

Schedule per optimizer step of G = gradient_accumulation_steps micro-batches:
    stages before the last:  F1 F2 .. FG (each sent on as soon as it is computed), then B1 .. BG
    the last stage:          F1 B1 F2 B2 .. FG BG (loop.train unchanged; each B sends its input gradients back)
so a stage before the last holds G micro-batches of activations (GPipe's memory) and the bubble is
(D - 1) / (G + D - 1) of a step for D decoder stages. DeepSpeed steps every stage at the same boundary: its
mpu (worlds.ModelParallelGroups) sums the gradient norm over the stages, so clipping and the NaN/inf skip are
decided for the whole model at once.

The last stage's gradient is already divided by G (engine.backward(loss) scales by GAS); the earlier stages
back-propagate it with `scale_wrt_gas=False` so it is not divided twice.
"""

from __future__ import annotations

import torch

from model_parallel import transport
from model_parallel.split import DecoderStage
from train.config import Config
from train.data import sources
from train.runtime import checkpoint
from train.runtime.collector import Collector
from train.runtime.engine import Dist
from train.trainer import loop


def _names(count: int) -> list[str]:
    """The message keys of a stage's `count` activations (or of their gradients)."""
    return [f"act{i}" for i in range(count)]


def activation_message(b: sources.Batch, x: tuple[torch.Tensor, ...]) -> tuple[dict, dict]:
    """The micro-batch and this stage's output, for the next stage."""
    meta, tensors = transport.batch_message(b)
    return {**meta, "activations": len(x)}, {**tensors, **dict(zip(_names(len(x)), x, strict=True))}


class _SendGradients(torch.autograd.Function):
    """Identity forward; backward sends the gradients of the stage's inputs to the previous stage."""

    @staticmethod
    def forward(ctx, sender, *x):
        ctx.sender = sender
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in x]
        return tuple(t.view_as(t) for t in x)

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros(s, dtype=dt, device=dv) if g is None else g for g, (s, dt, dv) in zip(grads, ctx.shapes,
                                                                                                      strict=True)]
        ctx.sender.send({"kind": "grads"}, dict(zip(_names(len(grads)), grads, strict=True)))
        return (None, *grads)


def receiving_converter(stage: DecoderStage, device: torch.device, grad_sender: transport.Sender, join):
    """For stages after the first: a message -> its Batch (`join`: the family's join_conditioning), with the
    activations put into the stage's inbox."""

    def convert(meta: dict, tensors: dict) -> sources.Batch:
        acts = [tensors.pop(k).to(device).requires_grad_() for k in _names(meta["activations"])]
        stage.inbox = _SendGradients.apply(grad_sender, *acts)
        return transport.message_batch(meta, tensors, device, join)

    convert.grad_sender = grad_sender
    return convert


def receive_gradients(link) -> list[torch.Tensor]:
    _, tensors = transport.recv(link, 1)
    return [tensors[k] for k in _names(len(tensors))]


def run_upstream_stage(cfg: Config, dp: Dist, eng, stage: DecoderStage, source, links, sender: transport.Sender,
                       scheduler_cfg: dict, trainer_state: dict, start_step: int, fam, watch=None) -> int:
    """A decoder stage before the last: forward G micro-batches, then backward them as gradients arrive; saves
    at the same steps as the last stage (every decoder process joins a save), and on a preemption (`watch`, as
    in loop.train) saves and raises preempt.Preempted with it. Returns the final step."""
    t, out = cfg.project.train, cfg.project.output
    dtype = getattr(torch, cfg.precision)
    gas = cfg.deepspeed["gradient_accumulation_steps"]
    eng.train()
    step = start_step
    with Collector(t.gc_every_steps, start_step) as collector:  # at the same steps as the last stage's
        while step < t.max_steps:
            outputs = []
            for micro in range(gas):
                b = source.next_batch()
                if stage.is_first:
                    generator = loop.micro_batch_generator(t.seed, step, micro, gas, dp, dp.device)
                    kwargs, _, _ = loop.noisy_inputs(b, t, generator, scheduler_cfg, dtype, fam)
                else:
                    kwargs = stage.cut.later_inputs(b)
                x = eng(**kwargs)
                sender.send(*activation_message(b, x))
                outputs.append(x)
            for x in outputs:
                grads = [g.to(dp.device) for g in receive_gradients(links.grads_from_next)]
                surrogate = sum((o * g).sum() for o, g in zip(x, grads, strict=True) if o.requires_grad)
                eng.backward(surrogate, scale_wrt_gas=False)  # d(surrogate)/d(theta) = g . d(output)/d(theta)
                eng.step()
            step += 1
            collector.after_step(step, loop.should_log(step, out, t.max_steps))
            with collector.automatic():
                loop.save_when_due(eng, step, t.max_steps, out, trainer_state, watch, dp)  # as the last stage does
    checkpoint.save(eng, out.dir, step, trainer_state, out.keep_last)
    return step
