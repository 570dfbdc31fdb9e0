"""A setting's prediction: the step's peak GPU memory, a validation render's, and the seconds per micro-batch in
the blocks (and per optimizer step on the host with DeepSpeed's optimizer offload).

    peak = resident weights + LoRA/optimizer state + encoders (online) + offload slots
           + max((blocks - N) x A + N x S + T, N x S + T_c)       (the first N blocks checkpointed)
    A = activations a plain block keeps for its backward, S = what a checkpointed block keeps (its inputs),
    T = the transient of the pass (a block's backward, the head, the loss); T_c = the same measured with
    checkpointing, where it holds a block's recomputed activations too. The two terms are the backward's two
    phases: the plain blocks (the last ones) go first, and a checkpointed block recomputes only once they have
    freed their activations (activation_phases). Each phase meets the LoRA/optimizer state as far as DeepSpeed has
    allocated it by then: ZeRO-2's bf16 gradient partition comes with its first reduced bucket, which LoRA's
    gradients of the backward's first blocks do not fill (Sizes.unreduced_partition_bytes, backward_bytes). Online
    encoding's transient E (measure.encode_transient) comes on top of that with data.encode_ahead, which encodes the
    next micro-batch during the step; without it the encode runs between the steps and the larger of E and the
    activations counts.

The LoRA/optimizer state is this rank's share as DeepSpeed's ZeRO stage splits it over the data-parallel ranks
(sizes.state_bytes_per_param); the optimizer step, which holds no activations but more gradient copies, is the
other bound on the peak. Weights and optimizer bytes are counted (train/plan/sizes.py); A, S, T and the block's
times are measured (train/plan/measure.py). Time per step is predicted as blocks x (forward + backward) +
checkpointed x forward + the copies of offloaded blocks that a block's compute does not hide.

With DeepSpeed's optimizer offload the fp32 master weights, the Adam moments and the fp32 gradient partition live in
pinned host memory and DeepSpeedCPUAdam steps there; the GPU keeps the bf16 weights of what trains, and at ZeRO
stage 1 their bf16 gradients until the backward ends (a LoRA parameter's 16 bytes on one GPU become 2 at stage 2, 4
at stage 1). Its price is the host step, charged per optimizer step as HOST_ADAM_BYTES per trainable parameter at
HOST_BYTES_PER_S (an allowance for the host's memory bandwidth, not a measurement) plus the bf16 gradients down and
weights up over PCIe (measured rate): ~1.3 s for LoRA r64 on the default targets, on top of the step.

A validation render (validation.file set) runs beside everything training keeps on the GPU:

    peak_render = resident weights + offload slots + LoRA/optimizer state + encoders (online)
                  + VAE (from the cache: the renders replay recorded conditioning with the VAE alone)
                  + max(R, V)
    R = the no-grad transformer pass's transient at the render's tokens (target and references at
        qwen_edit.inference.area, the prompt bound)
    V = the VAE's transient at inference.area: its decode of the result (and, online, its encode of the
        references), untiled and tiled (inference.vae_tiling)

R and V do not add: the denoising loop's activations are gone before the decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from train.plan.host import Host
from train.plan.measure import Measured
from train.plan.sizes import Sizes, moved_bytes

# The host optimizer step: DeepSpeedCPUAdam reads the fp32 weight, gradient and moments and writes weight, moments
# and the bf16 copy (30 bytes per parameter) at an allowance for a many-core host's memory bandwidth.
HOST_ADAM_BYTES = 30
HOST_BYTES_PER_S = 10e9


@dataclass(frozen=True)
class Choice:
    fp8_base: bool
    fp8_transposed: bool
    checkpointed: int  # the first N blocks recompute (0 = none)
    offloaded: int  # the first K blocks' frozen weights live on the host (K <= N)
    cached: bool  # train from the cache (no encoder on the GPU while training)
    offload_optimizer: bool = False  # DeepSpeed's optimizer offload: master, moments, fp32 grads on the host
    vae_tiling: bool | None = None  # inference.vae_tiling of the validation renders; None = no render to plan
    kept_attention: int = 0  # of the checkpointed blocks, how many keep their attention output (M <= N)


@dataclass(frozen=True)
class Prediction:
    peak_bytes: float
    step_s: float  # per micro-batch, in the blocks
    optimizer_s: float = 0.0  # per optimizer step on the host (offload_optimizer only)
    render_peak_bytes: float = 0.0  # a validation render's peak (0: validation off)

    @property
    def fit_bytes(self) -> float:
        """What must fit the budget: the step's peak or a validation render's, the larger."""
        return max(self.peak_bytes, self.render_peak_bytes)


def _block_bytes(s: Sizes, c: Choice, dtype_bytes: int) -> float:
    if not c.fp8_base:
        return s.block_params * dtype_bytes
    return (s.block_params - s.block_fp8_params) * dtype_bytes + s.block_fp8_params  # + row scales, ~0.1%


def host_bytes(s: Sizes, c: Choice, host: Host, dtype_bytes: int = 2) -> float:
    """Pinned host bytes of setting `c` on this node (train/plan/host.py): each process's offloaded blocks, or one
    copy for the node where they share it, and with DeepSpeed's optimizer offload each process's partition of the
    optimizer state."""
    blocks = c.offloaded * moved_bytes(s, c.fp8_base, dtype_bytes)
    state = s.host_state_bytes(host.world_size) if c.offload_optimizer else 0.0
    if host.shares(blocks):  # one copy of the blocks for the node, in /dev/shm
        return blocks + host.ranks_per_node * state
    return host.ranks_per_node * (blocks + state)


def fits_host(s: Sizes, c: Choice, host: Host) -> bool:
    """Whether `c`'s pinned host bytes fit the host's room (one that pins nothing always does)."""
    need = host_bytes(s, c, host)
    return need == 0 or need <= host.room_bytes


def activation_phases(s: Sizes, m: Measured, checkpointed: int) -> list[tuple[float, int]]:
    """The backward's activation peaks with the first `checkpointed` blocks recomputed, each with the number of
    blocks whose gradients exist by then. The backward visits the blocks last to first: the plain ones (N..) first,
    while every plain block's activations and every checkpointed block's inputs are kept (plus the plain transient T,
    in the first block's backward); a checkpointed block recomputes only after all plain blocks have freed theirs, so
    its recomputed activations (in the checkpointed transient) meet the checkpointed inputs alone, once the plain
    blocks and itself have made their gradients."""
    plain = s.num_blocks - checkpointed
    kept_inputs = checkpointed * m.ckpt_bytes
    phases = [(plain * m.act_bytes + kept_inputs + m.transient_bytes, 1)] if plain else []
    if checkpointed:
        ckpt_transient = (m.ckpt_transient_bytes if m.ckpt_transient_bytes is not None
                          else m.transient_bytes + m.act_bytes)
        phases.append((kept_inputs + ckpt_transient, plain + 1))
    return phases


def backward_bytes(s: Sizes, m: Measured, c: Choice) -> float:
    """The activations and the trainable state the GPU holds at the backward's peak beyond the weights: each phase
    of activation_phases with the state as far as DeepSpeed has allocated it by then
    (Sizes.unreduced_partition_bytes), plus what the checkpointed blocks that keep their attention hold."""
    state = s.gpu_state_bytes(c.offload_optimizer) + s.bucket_bytes(c.offload_optimizer)
    return c.kept_attention * m.kept_bytes + max(
        acts + state - s.unreduced_partition_bytes(c.offload_optimizer, done)
        for acts, done in activation_phases(s, m, c.checkpointed)
    )


def predict(s: Sizes, m: Measured, c: Choice, dtype_bytes: int = 2) -> Prediction:
    """Peak GPU bytes and seconds per micro-step of setting `c` (the formula of the module docstring)."""
    block = _block_bytes(s, c, dtype_bytes)
    offloaded_block = block - moved_bytes(s, c.fp8_base, dtype_bytes)  # what stays: vectors
    transposed = s.block_token_params if c.fp8_base and c.fp8_transposed else 0
    resident = s.num_blocks - c.offloaded
    weights = s.other_params * dtype_bytes + resident * (block + transposed) + c.offloaded * max(offloaded_block, 0)
    slots = 2 * block if c.offloaded else 0
    states = s.gpu_state_bytes(c.offload_optimizer) + s.bucket_bytes(c.offload_optimizer)
    encoders = 0 if c.cached else s.encoder_bytes
    backward = backward_bytes(s, m, c)  # the activations and the state at the backward's peak
    encode_peak = 0 if c.cached else m.encode_bytes
    on_gpu = weights + slots + encoders  # besides the trainable state
    held = on_gpu + states  # on the GPU through the steps and the renders between them
    in_step = on_gpu + s.gpu_state_bytes(c.offload_optimizer, in_step=True) + s.bucket_bytes(c.offload_optimizer)
    if s.encode_ahead:  # the next micro-batch encodes (on its own stream) during the whole step, optimizer included
        peak = max(on_gpu + backward, in_step) + encode_peak
    else:  # the encode runs between the steps; the optimizer step holds no activations
        peak = max(on_gpu + backward, held + encode_peak, in_step)
    render = 0.0
    if m.render_forward_bytes is not None:  # the decode follows the denoising loop: R and V do not add
        vae = m.render_vae_tiled_bytes if c.vae_tiling else m.render_vae_bytes
        render = held + (s.vae_bytes if c.cached else 0) + max(m.render_forward_bytes, vae)
    copy_s = (block - max(offloaded_block, 0)) / m.h2d_bytes_per_s
    bwd_s = m.fwd_bwd_s - m.fwd_s
    stall = c.offloaded * (max(0.0, copy_s - m.fwd_s) + max(0.0, copy_s - bwd_s))
    # Without the transposed copy the backward transposes each fp8 token weight: one read and write of it.
    transpose_s = 0.0 if not c.fp8_base or c.fp8_transposed else resident * 2 * s.block_token_params / 2e12
    kept_s = m.fwd_s if m.kept_recompute_s is None else m.kept_recompute_s
    recompute_s = (c.checkpointed - c.kept_attention) * m.fwd_s + c.kept_attention * kept_s
    step = s.num_blocks * m.fwd_bwd_s + recompute_s + stall + transpose_s
    return Prediction(peak, step, host_step_s(s, m) if c.offload_optimizer else 0.0, render)


def host_step_s(s: Sizes, m: Measured) -> float:
    """Seconds of one optimizer step offloaded to the host: DeepSpeedCPUAdam over every trainable parameter, the
    bf16 gradients copied down and the updated bf16 weights up (the module docstring)."""
    return s.trainable_params * (HOST_ADAM_BYTES / HOST_BYTES_PER_S + 2 * 2 / m.h2d_bytes_per_s)
