"""The memory plan (qwen_edit.memory): fit the run to the GPU it meets, as fast as it can be within it.

Before any model loads, the plan predicts the step's peak GPU memory for each candidate setting and picks the
fastest candidate that fits `budget - margin`:

    peak = resident weights + LoRA/optimizer state + encoders (online) + offload slots
           + max((blocks - N) x A + N x S + T, N x S + T_c)       (the first N blocks checkpointed)
    A = activations a plain block keeps for its backward, S = what a checkpointed block keeps (its inputs),
    T = the transient of the pass (a block's backward, the head, the loss); T_c = the same measured with
    checkpointing, where it holds a block's recomputed activations too. The two terms are the backward's two
    phases: the plain blocks (the last ones) go first, and a checkpointed block recomputes only once they have
    freed their activations (activation_bytes). Online encoding's transient E (encode_transient) comes on top of
    that with data.encode_ahead, which encodes the next micro-batch during the step; without it the encode runs
    between the steps and the larger of E and the activations counts

The LoRA/optimizer state is this rank's share as DeepSpeed's ZeRO stage splits it over the data-parallel ranks
(state_bytes_per_param); the optimizer step, which holds no activations but more gradient copies, is the other
bound on the peak.

Weights and optimizer bytes are counted from the transformer's config (the model built on the meta device).
A, S, T and the block's forward and backward times are measured: a one- and a two-block transformer of the real
width, prepared exactly as training prepares it (LoRA, fp8, compiled), run forward and backward at the largest
shape bucket of the dataset, plain and checkpointed; the difference between the two is one block, the rest is the
head. Time per step is
predicted as blocks x (forward + backward) + checkpointed x forward + the copies of offloaded blocks that a
block's compute does not hide.

The knobs it chooses, in the order that costs speed least: the fp8 base (faster and smaller; its transposed copy
when it fits), activation checkpointing of the first N blocks, offloading the frozen weights of the first K <= N
blocks to pinned host memory (train/model/offload.py), and for online encoding, training from the cache instead (the
encoders then never share the GPU with training). A key set in the config is never changed. Without a GPU there
is nothing to plan: the config runs as written.

Host memory is counted too: the offloaded blocks' frozen weights live in pinned host memory (one buffer pinned in
place, exactly its bytes, in their stored dtype). Where several training processes share a node and /dev/shm has the
room, the node keeps one copy in /dev/shm that each of them maps and pins (offload.NodeShare): K x (bytes of a
block's matrices); otherwise each process keeps its own, P x K x (bytes of a block's matrices). Plus, with
DeepSpeed's optimizer offload, P x its partition of the optimizer state (host_state_bytes: its pinned buffers as
torch rounds them). A candidate fits only when that stays below the smallest available host memory of any rank
(psutil) less host_margin_bytes; the plan then picks the fastest candidate that fits both, which offloads fewer
blocks and checkpoints more, or trains from the cache, where the host is short. When only the host stops every
candidate that fits the GPU, PlanError names the host figures and what to change; a config whose own
train.offload_blocks does not fit the host stops before loading, with the plan on or off.

The last resort, tried only when no setting of those knobs fits: DeepSpeed's own optimizer offload
(zero_optimization.offload_optimizer = {device: cpu, pin_memory: true}, ZeRO stage 1 or 2). The fp32 master
weights, the Adam moments and the fp32 gradient partition then live in pinned host memory and DeepSpeedCPUAdam
steps there; the GPU keeps the bf16 weights of what trains, and at ZeRO stage 1 their bf16 gradients until the
backward ends (a LoRA parameter's 16 bytes on one GPU become 2 at stage 2, 4 at stage 1).
Its price is the host step, charged per optimizer step as HOST_ADAM_BYTES per trainable parameter at
HOST_BYTES_PER_S (an allowance for the host's memory bandwidth, not a measurement) plus the bf16 gradients down and
weights up over PCIe (measured rate): ~1.3 s for LoRA r64 on the default targets, on top of the step. It is offered
only for Adam/AdamW (what DeepSpeed offloads to DeepSpeedCPUAdam), at ZeRO stage 1 or 2, when the host has the
memory for it, and when the DeepSpeed config does not set zero_optimization.offload_optimizer itself (then the
plan counts what it says).

Validation renders (validation.file set) must fit too: the first runs before step 1, beside everything training
keeps on the GPU. Their peak is

    peak_render = resident weights + offload slots + LoRA/optimizer state + encoders (online)
                  + VAE (from the cache: the renders replay recorded conditioning with the VAE alone)
                  + max(R, V)
    R = the no-grad transformer pass's transient at the render's tokens (target and references at
        qwen_edit.inference.area, the prompt bound), measured on a one-block transformer prepared as training
        prepares it but eager (expected to bound the compiled pass the renders run; not checked on a GPU yet)
    V = the VAE's transient at inference.area: its decode of the result (and, online, its encode of the
        references), measured untiled and tiled (inference.vae_tiling)

R and V do not add: the denoising loop's activations are gone before the decode. The plan fits
max(peak, peak_render); when only the render does not fit it turns on inference.vae_tiling (when the config does
not set it) before it costs the step anything, and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GB = 1e9
# DeepSpeed's bytes on each GPU per trainable parameter, bf16 mixed precision with Adam over a data-parallel world
# of W ranks (state_bytes_per_param; counted from deepspeed/runtime/zero/stage_1_and_2.py and checked against its
# live buffers on the CPU in tests/test_memory.py). While the backward runs: the bf16 weight 2 (a LoRA parameter's;
# a full fine-tune's is counted with the model's), its bf16 gradient 2 (stage 2 keeps only its 1/W partition once
# a bucket is reduced; stage 1 holds every gradient until the backward's end), the fp32 master 4 and the two Adam
# moments 8, split over the ranks by ZeRO stages 1 and 2 (stage 0 keeps all of them on every rank). In the step,
# after the activations are gone, stages 1 and 2 hold the bf16 gradient partition, its flattened copy and its fp32
# copy at once (8/W), beside the master and moments: 2 + 20/W. Plus DeepSpeed's gradient buckets (bucket_bytes).
WEIGHT_BYTES = 2
MASTER_AND_MOMENTS_BYTES = 12
STEP_GRAD_BYTES = 8  # the step's bf16 gradient partition + its flattened copy + its fp32 copy
STAGE0_STEP_BYTES = 20  # stage 0 (DeepSpeed's bf16 optimizer): weight, bf16 and fp32 gradients, master, moments
# With DeepSpeed's optimizer offload the master, moments and fp32 gradients are in host memory: a LoRA parameter
# keeps its bf16 weight on the GPU, and its bf16 gradient only at stage 1 (stage 2 hands each reduced bucket to the
# host and frees its gradients; measured on the H200: docs/performance.md "The last resort"). The host holds 18
# bytes per parameter, 10 of them pinned by torch, which rounds each allocation up to a power of two
# (host_state_bytes).
# The host optimizer step: DeepSpeedCPUAdam reads the fp32 weight, gradient and moments and writes weight, moments
# and the bf16 copy (30 bytes per parameter) at an allowance for a many-core host's memory bandwidth.
HOST_ADAM_BYTES = 30
HOST_BYTES_PER_S = 10e9
OFFLOADABLE_OPTIMIZERS = ("adam", "adamw")  # DeepSpeed steps these on the host with DeepSpeedCPUAdam
BUCKET_BYTES = 2e8 * 2  # one bucket of the shipped configs' reduce_bucket_size (2e8 bf16 elements): Sizes' default
REDUCE_BUCKET_DEFAULT = 5e8  # DeepSpeed's reduce_bucket_size when the config leaves it out
VL_ACTIVATION_BYTES = 1 * GB  # the VL model's activations for an encode (no gradients): an allowance
ONLINE_SLACK = 1.1  # online encoding is kept while its step is at most this much slower than the cached one's
PLAN_KEYS = ("train.fp8_base", "train.fp8_transposed", "train.compile", "train.gradient_checkpointing",
             "train.checkpoint_blocks", "train.offload_blocks", "train.kept_attention_blocks", "data.cache",
             "inference.vae_tiling")
OFFLOAD_KEY = "zero_optimization.offload_optimizer"  # DeepSpeed's key: in `fixed` when its config sets it


class PlanError(ValueError):
    """Nothing fits the budget: the message has the numbers and what to change."""


@dataclass(frozen=True)
class Host:
    """This node's host memory as the plan counts it: the available bytes (the smallest any rank saw; inf = not
    counted) and the training processes that share it (each pins its own offloaded blocks)."""

    available_bytes: float = math.inf
    ranks_per_node: int = 1
    world_size: int = 1
    shm_bytes: float = 0.0  # free /dev/shm (the smallest any rank of the node saw): room for one shared copy

    def shares(self, blocks_bytes: float) -> bool:
        """Whether the node's processes share one copy of `blocks_bytes` of offloaded weights (offload.can_share:
        the rule the offloader follows)."""
        from train.model.offload import can_share

        return can_share(blocks_bytes, self.ranks_per_node, self.shm_bytes)

    @property
    def margin_bytes(self) -> float:
        """Left free beside the pinned buffers: 2 GB per process (the loader's tensor in flight, DeepSpeed's and
        torch's host buffers, the data workers' growth) and 5% of the available memory; an allowance, not a
        measurement."""
        return 0.0 if math.isinf(self.available_bytes) else 2 * GB * self.ranks_per_node + 0.05 * self.available_bytes

    @property
    def room_bytes(self) -> float:
        return self.available_bytes - self.margin_bytes


@dataclass(frozen=True)
class Sizes:
    """Counted parameters of the transformer (and bytes of the encoders when they share the GPU)."""

    num_blocks: int
    block_params: int  # every parameter of one block (all frozen under LoRA)
    block_matrix_params: int  # the matrices among them (what offloading moves)
    block_fp8_params: int  # the linears train.fp8_base stores in e4m3
    block_token_params: int  # the token linears among those (train.fp8_transposed stores them twice)
    other_params: int  # outside the blocks (embeddings, norm_out, proj_out)
    lora_params: int  # trainable LoRA parameters of the whole model
    encoder_bytes: int = 0  # Qwen2.5-VL + VAE in their dtype
    encode_ahead: bool = False  # online, the next micro-batch encodes while this one trains (data.encode_ahead)
    vae_bytes: int = 0  # the VAE alone (what a validation render from the cache loads beside the model)
    full: bool = False  # every weight trains (train.mode = "full"): optimizer state for all of them
    zero_stage: int = 2  # DeepSpeed's zero_optimization.stage: how the trainable state is split over the ranks
    dp_world: int = 1  # data-parallel ranks that split it
    accumulation_pinned: int = 0  # what DeepSpeed's optimizer offload pins for gradient accumulation, whole model
    accumulating: bool = False  # gradient_accumulation_steps > 1: that is pinned
    bucket: float = BUCKET_BYTES  # bytes of one of DeepSpeed's gradient buckets (bucket_sizes)
    buckets: int = 1  # how many it allocates: 2 with overlap_comm
    contiguous_gradients: bool = True  # zero_optimization.contiguous_gradients (the buckets exist only with it)

    def bucket_bytes(self, offload_optimizer: bool) -> float:
        """DeepSpeed's gradient buckets on each GPU from the backward's start to the step (ZeRO stages 1 and 2 with
        contiguous gradients, which its optimizer offload always turns on; stage 0 has none): a hook copies each
        gradient into the bucket that is filling, with overlap_comm a second one is reduced meanwhile. Checked against
        DeepSpeed's own buffers in tests/test_memory.py."""
        if self.zero_stage not in (1, 2) or not (self.contiguous_gradients or offload_optimizer):
            return 0.0
        return self.bucket * self.buckets

    def host_state_bytes(self, world_size: int) -> float:
        """host_state_bytes of one rank, with the accumulation buffers when the run accumulates."""
        return host_state_bytes(self.trainable_params, world_size,
                                self.accumulation_pinned if self.accumulating else 0)

    @property
    def trainable_params(self) -> int:
        return self.num_blocks * self.block_params + self.other_params if self.full else self.lora_params

    @property
    def state_bytes(self) -> float:
        return self.gpu_state_bytes(offload_optimizer=False)

    def gpu_state_bytes(self, offload_optimizer: bool, in_step: bool = False) -> float:
        """The trainable parameters' bytes on each GPU beyond the model's weights while the backward runs (or, with
        `in_step`, in the optimizer step), with or without DeepSpeed's optimizer offload."""
        return self.trainable_params * state_bytes_per_param(self.full, self.zero_stage, self.dp_world,
                                                             offload_optimizer, in_step)


def state_bytes_per_param(full: bool, stage: int, world: int, offload_optimizer: bool, in_step: bool = False) -> float:
    """Bytes per trainable parameter on each of `world` GPUs under ZeRO `stage` (the comment at WEIGHT_BYTES): at the
    backward's peak, or with `in_step` in the optimizer step (no activations then). A full fine-tune's weight is
    counted with the model's, so it is left out here."""
    own_weight = 0 if full else WEIGHT_BYTES
    grad = WEIGHT_BYTES / world if stage == 2 else WEIGHT_BYTES
    if offload_optimizer:  # DeepSpeed offloads at stage 1 or 2 only (offload_blocker)
        # Stage 2 copies each reduced bucket's gradients to the host and frees them there and then
        # (copy_grads_in_partition; DeepSpeed turns contiguous_gradients on whenever it offloads, whatever the
        # config says): only the bucket stays, counted apart. Stage 1 reduces once the backward has ended, so every
        # bf16 gradient exists until then.
        return own_weight + (0 if stage == 2 else WEIGHT_BYTES)
    if stage == 0:
        return (STAGE0_STEP_BYTES if in_step else WEIGHT_BYTES + WEIGHT_BYTES + MASTER_AND_MOMENTS_BYTES) - (
            WEIGHT_BYTES - own_weight)
    if in_step:
        return own_weight + (MASTER_AND_MOMENTS_BYTES + STEP_GRAD_BYTES) / world
    return own_weight + grad + MASTER_AND_MOMENTS_BYTES / world


@dataclass(frozen=True)
class Measured:
    """One short measurement at the largest bucket (see the module docstring), bytes and seconds."""

    act_bytes: float  # A
    ckpt_bytes: float  # S
    transient_bytes: float  # T
    fwd_s: float  # one block's forward
    fwd_bwd_s: float  # one block's forward and backward
    h2d_bytes_per_s: float = 25e9  # pinned host -> device copies
    encode_bytes: float = 0.0  # the encoders' activations while encoding (online)
    ckpt_transient_bytes: float | None = None  # T when blocks are checkpointed (a recomputation is in it); None = T + A
    render_forward_bytes: float | None = None  # R: a validation render's transformer pass; None = validation off
    render_vae_bytes: float = 0.0  # V untiled (math.inf: it did not fit the budget even alone)
    render_vae_tiled_bytes: float = 0.0  # V with inference.vae_tiling
    kept_bytes: float = 0.0  # X: what a checkpointed block that keeps its attention output holds (0 = no kernel)
    kept_recompute_s: float | None = None  # that block's recomputation (attention skipped); None = fwd_s


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


def moved_bytes(s: Sizes, fp8_base: bool, dtype_bytes: int = 2) -> float:
    """Bytes of one offloaded block's pinned host buffer: its frozen matrices in their stored dtype (e4m3 for the
    fp8 linears under train.fp8_base; offloaded blocks keep no transposed copy)."""
    if not fp8_base:
        return s.block_matrix_params * dtype_bytes
    return s.block_fp8_params + (s.block_matrix_params - s.block_fp8_params) * dtype_bytes


def pinned_bytes(nbytes: float) -> float:
    """What a pinned tensor of `nbytes` takes from the host: torch's pinned allocator (CachingHostAllocator) rounds
    every allocation up to a power of two, unless PYTORCH_CUDA_ALLOC_CONF sets pinned_max_round_threshold."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


def host_state_bytes(trainable_params: int, world_size: int, accumulation_pinned: float = 0) -> float:
    """Host bytes of DeepSpeed's optimizer offload on one rank (ZeRO 1 or 2, pin_memory, the trainer's one parameter
    group; deepspeed/runtime/zero/stage_1_and_2.py): the rank's partition of n parameters has its fp32 master weights
    (4n), fp32 gradients (4n) and a bf16 copy for the updated weights (2n) in three pinned tensors, each rounded up
    to a power of two (pinned_bytes), and the two Adam moments (8n) in ordinary memory (the optimizer makes them
    with zeros_like). The 18 bytes per parameter this once counted flat missed the rounding: 110.8 GB for a full
    fine-tune of 18 blocks, where the rounded buffers take 135 GB (killed on a 128 GiB host, session 14). With
    gradient_accumulation_steps > 1 DeepSpeed also pins a bf16 gradient for each parameter of the partition, each
    its own tensor (async_accumulate_grad_in_cpu_via_gpu): `accumulation_pinned`, those of the whole model as torch
    pins them (trainable_pinned_bf16), of which a rank holds its share."""
    n = trainable_params / world_size
    return 2 * pinned_bytes(4 * n) + pinned_bytes(2 * n) + 8 * n + accumulation_pinned / world_size


def trainable_pinned_bf16(numels) -> int:
    """Host bytes of one pinned bf16 tensor per trainable parameter of these sizes (each rounded up to a power of
    two by torch's pinned allocator): DeepSpeed's gradient accumulation buffers under optimizer offload."""
    return sum(pinned_bytes(2 * n) for n in numels)


def host_bytes(s: Sizes, c: Choice, host: Host, dtype_bytes: int = 2) -> float:
    """Pinned host bytes of candidate `c` on this node (the module docstring): each process's offloaded blocks and,
    with DeepSpeed's optimizer offload, its partition of the optimizer state."""
    blocks = c.offloaded * moved_bytes(s, c.fp8_base, dtype_bytes)
    state = s.host_state_bytes(host.world_size) if c.offload_optimizer else 0.0
    if host.shares(blocks):  # one copy of the blocks for the node, in /dev/shm
        return blocks + host.ranks_per_node * state
    return host.ranks_per_node * (blocks + state)


def fits_host(s: Sizes, c: Choice, host: Host) -> bool:
    """Whether `c`'s pinned host bytes fit the host's room (one that pins nothing always does)."""
    need = host_bytes(s, c, host)
    return need == 0 or need <= host.room_bytes


def host_refusal(s: Sizes, c: Choice, host: Host, fixed: dict, dtype_bytes: int = 2) -> str:
    """Why `c` does not fit this node's host memory, with its figures and what to change (a PlanError's text)."""
    per_block = moved_bytes(s, c.fp8_base, dtype_bytes)
    kind = 'fp8' if c.fp8_base else 'bf16'
    if host.shares(c.offloaded * per_block):
        parts = (f"one copy for the node's {host.ranks_per_node} training processes in /dev/shm of {c.offloaded} "
                 f"offloaded blocks x {per_block / GB:.2f} GB ({kind} weights)")
    else:
        parts = (f"{host.ranks_per_node} training process(es) on this node x {c.offloaded} offloaded blocks x "
                 f"{per_block / GB:.2f} GB ({kind} weights)")
    if c.offload_optimizer:
        state = host.ranks_per_node * s.host_state_bytes(host.world_size)
        parts += f" + {state / GB:.1f} GB of DeepSpeed's offloaded optimizer state"
    pinned = ""
    if "train.offload_blocks" in fixed:
        pinned = (f" qwen_edit.train.offload_blocks = {fixed['train.offload_blocks']} is set in the config: set fewer "
                  "blocks, or leave the key out so that the plan chooses what fits.")
    return (f"{host_bytes(s, c, host, dtype_bytes) / GB:.1f} GB of pinned host memory ({parts}), and "
            f"{host.available_bytes / GB:.1f} GB is available, less a {host.margin_bytes / GB:.1f} GB margin.{pinned} "
            "To fit: fewer training processes per node (deepspeed --num_gpus), a larger qwen_edit.memory.budget_gb "
            "where the GPU has more, data.cache \"auto\" (no encoders on the GPU: more blocks stay there), a smaller "
            "qwen_edit.data.area, or more free host memory (fewer qwen_edit.data.num_workers, other jobs)")


def activation_bytes(s: Sizes, m: Measured, checkpointed: int) -> float:
    """The pass's activation peak with the first `checkpointed` blocks recomputed. The backward visits the blocks
    last to first: the plain ones (N..) first, while every plain block's activations and every checkpointed
    block's inputs are kept (plus the plain transient T); a checkpointed block recomputes only after all plain
    blocks have freed theirs, so its recomputed activations (in the checkpointed transient) meet the checkpointed
    inputs alone. The peak is the larger of the two phases, not their sum."""
    plain = s.num_blocks - checkpointed
    kept_inputs = checkpointed * m.ckpt_bytes
    first = plain * m.act_bytes + kept_inputs + m.transient_bytes if plain else 0.0
    if not checkpointed:
        return first
    ckpt_transient = m.ckpt_transient_bytes if m.ckpt_transient_bytes is not None else m.transient_bytes + m.act_bytes
    return max(first, kept_inputs + ckpt_transient)


def predict(s: Sizes, m: Measured, c: Choice, dtype_bytes: int = 2) -> Prediction:
    """Peak GPU bytes and seconds per micro-step of candidate `c` (the formula of the module docstring)."""
    block = _block_bytes(s, c, dtype_bytes)
    offloaded_block = block - moved_bytes(s, c.fp8_base, dtype_bytes)  # what stays: vectors
    transposed = s.block_token_params if c.fp8_base and c.fp8_transposed else 0
    resident = s.num_blocks - c.offloaded
    weights = s.other_params * dtype_bytes + resident * (block + transposed) + c.offloaded * max(offloaded_block, 0)
    slots = 2 * block if c.offloaded else 0
    states = s.gpu_state_bytes(c.offload_optimizer) + s.bucket_bytes(c.offload_optimizer)
    encoders = 0 if c.cached else s.encoder_bytes
    acts = activation_bytes(s, m, c.checkpointed) + c.kept_attention * m.kept_bytes  # both backward phases hold X
    encode_peak = 0 if c.cached else m.encode_bytes
    kept = weights + slots + states + encoders  # on the GPU through the steps and the renders between them
    in_step = (weights + slots + encoders + s.gpu_state_bytes(c.offload_optimizer, in_step=True)
               + s.bucket_bytes(c.offload_optimizer))
    if s.encode_ahead:  # the next micro-batch encodes (on its own stream) during the whole step, optimizer included
        peak = max(kept + acts, in_step) + encode_peak
    else:  # the encode runs between the steps; the optimizer step holds no activations
        peak = max(kept + max(acts, encode_peak), in_step)
    render = 0.0
    if m.render_forward_bytes is not None:  # the decode follows the denoising loop: R and V do not add
        vae = m.render_vae_tiled_bytes if c.vae_tiling else m.render_vae_bytes
        render = kept + (s.vae_bytes if c.cached else 0) + max(m.render_forward_bytes, vae)
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


def candidates(s: Sizes, fixed: dict, fp8_ok: bool, online: bool, render: bool = False):
    """Every Choice the config's explicit keys (`fixed`, dotted key -> value) allow; with `render` (validation on)
    untiled and tiled VAE decodes of the validation renders."""
    fp8s = [fixed["train.fp8_base"]] if "train.fp8_base" in fixed else [True, False]
    fp8_ok = fp8_ok and not s.full
    n = s.num_blocks
    if "train.gradient_checkpointing" in fixed and not fixed["train.gradient_checkpointing"]:
        ckpts = [0]
    elif "train.checkpoint_blocks" in fixed:
        ckpts = [fixed["train.checkpoint_blocks"] or n]
    elif fixed.get("train.gradient_checkpointing"):
        ckpts = list(range(1, n + 1))
    else:
        ckpts = list(range(0, n + 1))
    cached = [fixed["data.cache"] != "off"] if "data.cache" in fixed else ([False, True] if online else [True])
    if not online:
        cached = [True]
    offloads = [fixed[OFFLOAD_KEY]] if OFFLOAD_KEY in fixed else [False, True]
    tilings = ([fixed["inference.vae_tiling"]] if "inference.vae_tiling" in fixed else [False, True]) if (
        render) else [None]
    kept = fixed.get("train.kept_attention_blocks", 0)  # free: 0 here, raised by choose as far as it fits
    for fp8_base in fp8s:
        if fp8_base and not fp8_ok:
            continue
        transposed = [fixed["train.fp8_transposed"]] if "train.fp8_transposed" in fixed else [True, False]
        for fp8_t in transposed if fp8_base else [False]:
            for ck in ckpts:
                offs = [fixed["train.offload_blocks"]] if "train.offload_blocks" in fixed else range(0, ck + 1)
                offs = [0] if s.full else offs  # full fine-tuning offloads with ZeRO, not this
                for off in offs:
                    if off <= ck:
                        for cache in cached:
                            for opt in offloads:
                                for tiled in tilings:
                                    yield Choice(fp8_base, fp8_t, ck, off, cache, opt, tiled,
                                                 ck if kept < 0 else min(kept, ck))


def choose(s: Sizes, m: Measured, budget_bytes: float, margin_bytes: float, fixed: dict, fp8_ok: bool,
           online: bool, offload_blocker: str | None = None, host: Host = Host()) -> tuple[Choice, Prediction]:
    """The fastest candidate whose predicted peak fits budget - margin (ties: the smaller peak). Online encoding,
    when that is the config's, is kept while its best step is within ONLINE_SLACK of the best cached one (the
    cache costs a pass over the data and disk space). DeepSpeed's optimizer offload comes last: only when no
    candidate without it fits, and only when `offload_blocker` is None (else it says why DeepSpeed cannot offload
    this run's optimizer; a config that sets the key itself pins it in `fixed` instead). With validation renders
    (m.render_forward_bytes set) a candidate fits when its step and its render both do; among equally fast ones an
    untiled VAE decode wins. A candidate fits only when its pinned host bytes fit `host` too (host_bytes). PlanError
    with the smallest peak found when nothing fits, and what the offload would need when only it is missing, what
    lowers a render when only the renders do not fit, or the host's figures when only the host stops the rest."""
    allowed = list(candidates(s, fixed, fp8_ok, online, m.render_forward_bytes is not None))
    if not allowed:
        raise PlanError("the config's explicit settings leave no candidate to plan (see qwen_edit.memory)")
    room = budget_bytes - margin_bytes
    scored = [(c, predict(s, m, c)) for c in allowed]
    if "train.kept_attention_blocks" not in fixed and m.kept_bytes > 0:
        scored = [most_kept(s, m, c, p, room) for c, p in scored]
    on_gpu = [x for x in scored if not x[0].offload_optimizer]
    offloaded = [x for x in scored if x[0].offload_optimizer]
    usable = on_gpu + (offloaded if offload_blocker is None or OFFLOAD_KEY in fixed else [])
    for group in (on_gpu, usable):
        best = _fastest([x for x in group if x[1].fit_bytes <= room and fits_host(s, x[0], host)])
        if best:
            return best
    gpu_fits = [x[0] for x in usable if x[1].fit_bytes <= room]
    if gpu_fits:  # only the host's memory stops them
        c = min(gpu_fits, key=lambda c: host_bytes(s, c, host))
        raise PlanError(f"nothing fits this node's host memory: only settings that pin host memory fit the GPU "
                        f"budget ({budget_bytes / GB:.1f} GB with a {margin_bytes / GB:.1f} GB margin), and the one "
                        f"that needs the least ({describe(c, s.num_blocks)}) needs {host_refusal(s, c, host, fixed)}")
    c, p = min(usable or scored, key=lambda x: x[1].fit_bytes)
    steps_fit = [x for x in usable or scored if x[1].peak_bytes <= room]
    if steps_fit:  # only the validation renders do not fit
        rc, rp = min(steps_fit, key=lambda x: x[1].render_peak_bytes)
        raise PlanError(
            f"nothing fits the memory budget with validation renders: {budget_bytes / GB:.1f} GB with a "
            f"{margin_bytes / GB:.1f} GB margin; the training step fits, but a render of qwen_edit.validation.file "
            f"(the first runs before step 1) needs {rp.render_peak_bytes / GB:.1f} GB at the least "
            f"({describe(rc, s.num_blocks)}). {oom_advice('validation', 1)}")
    unused = "" if offload_blocker is None or OFFLOAD_KEY in fixed or not offloaded else _unused_offload(
        offloaded, room, s.num_blocks, offload_blocker)
    unused += _full_hint(s, m, allowed, room)
    raise PlanError(
        f"nothing fits the memory budget: {budget_bytes / GB:.1f} GB with a {margin_bytes / GB:.1f} GB margin; "
        f"the smallest setting allowed ({describe(c, s.num_blocks)}) needs {p.fit_bytes / GB:.1f} GB.{unused} Lower "
        f"qwen_edit.data.area or the micro-batch, {'' if s.full else 'a lower qwen_edit.lora.rank, '}remove "
        "settings that pin the plan (train.fp8_base false, train.gradient_checkpointing false, data.cache off), "
        "or use a bigger GPU or the model-parallel mode"
    )


def most_kept(s: Sizes, m: Measured, c: Choice, p: Prediction, room: float) -> tuple[Choice, Prediction]:
    """`c` (predicted `p`, keeping no attention) with as many of its checkpointed blocks keeping their attention
    output as fit `room`: each adds m.kept_bytes to the activation peak and nothing else, and only makes the step
    faster, so the largest count that fits is the best."""
    if not c.checkpointed or p.fit_bytes > room:
        return c, p
    best, lo, hi = (c, p), 0, c.checkpointed  # best fits with `lo` kept; find the largest count that still fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = dataclasses.replace(c, kept_attention=mid)
        q = predict(s, m, trial)
        if q.fit_bytes <= room:
            best, lo = (trial, q), mid
        else:
            hi = mid - 1
    return best


def render_note(s: Sizes, m: Measured, c: Choice, p: Prediction, budget_bytes: float, margin_bytes: float,
                fixed: dict, fp8_ok: bool, online: bool, offload_blocker: str | None = None,
                host: Host = Host()) -> str:
    """The plan line's words on validation renders: their predicted peak and, when they changed the plan (the VAE
    decode tiled, or a slower step than the step alone needs), what and why, naming the keys that lower a render.
    "" with validation off."""
    if m.render_forward_bytes is None:
        return ""
    text = f"; a validation render peaks at {p.render_peak_bytes / GB:.1f} GB"
    try:
        alone, q = choose(s, dataclasses.replace(m, render_forward_bytes=None), budget_bytes, margin_bytes, fixed,
                          fp8_ok, online, offload_blocker, host)
    except PlanError:
        return text
    if dataclasses.replace(c, vae_tiling=None) == alone:
        if not c.vae_tiling:
            return text
        untiled = predict(s, m, dataclasses.replace(c, vae_tiling=False)).render_peak_bytes
        return (f"{text} with inference.vae_tiling = true, which the plan chose: untiled it would need "
                f"{untiled / GB:.1f} GB, and the step is the same either way")
    tilings = [fixed["inference.vae_tiling"]] if "inference.vae_tiling" in fixed else [False, True]
    needs = min(predict(s, m, dataclasses.replace(alone, vae_tiling=t)).render_peak_bytes for t in tilings)
    pinned = " (inference.vae_tiling is set false in the config)" if tilings == [False] else ""
    return (f"{text}; the renders set this plan: the step alone would fit with {describe(alone, s.num_blocks)} "
            f"(~{q.step_s:.2f} s per micro-batch), but its render would need {needs / GB:.1f} GB{pinned}. "
            f"{oom_advice('validation', 1)}")


def _fastest(fits: list) -> tuple[Choice, Prediction] | None:
    """choose's pick among candidates that fit: online while within ONLINE_SLACK of the cached step, else cached."""
    best = {cached: min((x for x in fits if x[0].cached == cached),
                        key=lambda x: (x[1].step_s, bool(x[0].vae_tiling), x[1].peak_bytes), default=None)
            for cached in (False, True)}
    if best[False] and (not best[True] or best[False][1].step_s <= ONLINE_SLACK * best[True][1].step_s):
        return best[False]
    return best[True]


def _full_hint(s: Sizes, m: Measured, allowed: list[Choice], room: float, most: int = 1024) -> str:
    """The sentence of a PlanError for full fine-tuning: the fewest data-parallel GPUs over which ZeRO stage 2
    splits the optimizer state enough for one of the `allowed` settings to fit (every GPU holds the whole bf16
    model), or that no number does."""
    if not s.full:
        return ""
    on_gpu = {dataclasses.replace(c, offload_optimizer=False) for c in allowed}  # the state split, not moved

    def at(world: int) -> float:
        return min(predict(dataclasses.replace(s, zero_stage=2, dp_world=world), m, c).fit_bytes for c in on_gpu)

    if at(most) > room:
        return (f" Full fine-tuning does not fit at any number of GPUs: every GPU holds the whole model "
                f"({s.num_blocks * s.block_params + s.other_params:,} parameters in bf16) and its activations; "
                "train a LoRA (qwen_edit.train.mode \"lora\") or use a GPU with more memory.")
    start = max(s.dp_world, 1) + (1 if s.zero_stage == 2 else 0)  # stage 0 or 1 may fit at this world with 2
    world = next(w for w in range(start, most + 1) if at(w) <= room)
    return (f" Full fine-tuning fits with ZeRO stage 2 (zero_optimization.stage 2) over {world} or more GPUs "
            f"(data-parallel ranks: deepspeed --num_gpus, or a hostfile for several nodes), which split the fp32 "
            f"master weights, Adam moments and gradients: {at(world) / GB:.1f} GB each at {world}.")


def _unused_offload(offloaded: list, room: float, num_blocks: int, blocker: str) -> str:
    """The sentence of a PlanError about the optimizer offload the plan could not use."""
    c, p = min(offloaded, key=lambda x: x[1].fit_bytes)
    verdict = "would fit" if p.fit_bytes <= room else "would still not fit"
    return (f" With DeepSpeed's optimizer offload (zero_optimization.offload_optimizer) the run {verdict}: "
            f"{describe(c, num_blocks)} needs {p.fit_bytes / GB:.1f} GB, of {room / GB:.1f} GB; but {blocker}.")


def describe(c: Choice, num_blocks: int) -> str:
    transposed = c.fp8_transposed and c.offloaded < num_blocks  # offloaded blocks keep no transposed copy
    fp8 = ("fp8 base + transposed copy" if transposed else "fp8 base") if c.fp8_base else "bf16 base"
    ck = "no checkpointing" if not c.checkpointed else (
        "all blocks checkpointed" if c.checkpointed >= num_blocks else f"first {c.checkpointed} blocks checkpointed")
    if c.kept_attention and c.checkpointed:
        ck += (" (all keep their attention output)" if c.kept_attention >= c.checkpointed else
               f" ({c.kept_attention} of them keep their attention output)")
    off = f", first {c.offloaded} blocks offloaded to host memory" if c.offloaded else ""
    enc = "from the cache" if c.cached else "online encoding"
    opt = ", optimizer state in host memory (DeepSpeed offload_optimizer, Adam steps on the CPU)" if (
        c.offload_optimizer) else ""
    vae = {None: "", False: ", validation VAE decode untiled", True: ", validation VAE decode tiled"}[c.vae_tiling]
    return f"{fp8}, {ck}{off}, {enc}{opt}{vae}"


def settings(c: Choice, num_blocks: int) -> dict:
    """The config keys (dotted, under qwen_edit) that realise `c` (inference.vae_tiling only with a render)."""
    values = {"train.fp8_base": c.fp8_base, "train.fp8_transposed": c.fp8_transposed,
              "train.gradient_checkpointing": c.checkpointed > 0,
              "train.checkpoint_blocks": 0 if c.checkpointed in (0, num_blocks) else c.checkpointed,
              "train.offload_blocks": c.offloaded, "train.kept_attention_blocks": c.kept_attention}
    if c.vae_tiling is not None:
        values["inference.vae_tiling"] = c.vae_tiling
    return values


# ---------------------------------------------------------------- counting


def count_sizes(model_dir: str | Path, target_modules: list[str], rank: int, encoder_bytes: int = 0,
                full: bool = False) -> Sizes:
    """Sizes of the transformer of `model_dir`, counted on the meta device (nothing is allocated)."""
    from train.model import fp8, streaming

    model = streaming.empty_transformer(Path(model_dir) / "transformer")
    block = model.transformer_blocks[0]
    block_params = sum(p.numel() for p in block.parameters())
    matrices = sum(p.numel() for p in block.parameters() if p.dim() >= 2)
    fp8_params = token = 0
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = fp8._kind(f"transformer_blocks.0.{name}")
            fp8_params += module.weight.numel() if kind else 0
            token += module.weight.numel() if kind == "token" else 0
    lora, lora_numels = 0, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in target_modules):
            lora += rank * (module.in_features + module.out_features)
            lora_numels += [rank * module.in_features, rank * module.out_features]  # lora_A, lora_B
    total = sum(p.numel() for p in model.parameters())
    n = len(model.transformer_blocks)
    numels = [p.numel() for p in model.parameters()] if full else lora_numels
    return Sizes(n, block_params, matrices, fp8_params, token, total - n * block_params, 0 if full else lora,
                 encoder_bytes, full=full, accumulation_pinned=trainable_pinned_bf16(numels))


def encoder_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Bytes of Qwen2.5-VL and the VAE in a 2-byte dtype, from their safetensors headers (no weights read)."""
    return sum(component_bytes(model_dir, sub, dtype_bytes) for sub in ("text_encoder", "vae"))


def component_bytes(model_dir: str | Path, sub: str, dtype_bytes: int = 2) -> int:
    """Bytes of the component in `model_dir`/`sub` (text_encoder, vae) in a 2-byte dtype, from its safetensors
    headers, or from its config when it has no weights (QWEN_EDIT_RANDOM_INIT directories)."""
    files = sorted((Path(model_dir) / sub).glob("*.safetensors"))
    numel = sum(_numel_in_header(path) for path in files) if files else _numel_from_config(Path(model_dir) / sub)
    return numel * dtype_bytes


def _numel_in_header(path: Path) -> int:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _numel_from_config(sub: Path) -> int:
    """Parameter count of a component that has only its config (QWEN_EDIT_RANDOM_INIT directories)."""
    from accelerate import init_empty_weights

    if sub.name == "vae":
        from diffusers import AutoencoderKLQwenImage

        with init_empty_weights():
            m = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(sub))
    else:
        from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

        with init_empty_weights():
            m = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(sub))
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Workload:
    """The largest micro-batch of the run, in tokens."""

    batch: int
    image_tokens: int  # target + references, packed 2x2 latent patches
    target_hw: tuple[int, int]  # latent h, w of the target (the rest of image_tokens are references)
    text_tokens: int


def largest_bucket(bucket_keys: list[tuple[tuple[int, int], ...]], micro_batch: int, text_tokens: int) -> Workload:
    """The bucket with the most image tokens (latent (h, w) per image, as the datasets' bucket_keys give them)."""
    key = max(bucket_keys, key=lambda k: sum(h * w for h, w in k))
    tokens = sum((h // 2) * (w // 2) for h, w in key)
    return Workload(micro_batch, tokens, key[0], text_tokens)


def text_tokens_bound(variant: str, num_references: int, area: int, condition_area: int) -> int:
    """Prompt embeddings per sample, bounded: the template and prompt text (at most ~320 tokens after the dropped
    prefix) plus the VL image tokens of each reference (28 x 28 px each; v1 shows the VL its VAE-size copy)."""
    vl_area = area if variant == "edit" else condition_area
    return 320 + num_references * vl_area // (28 * 28)


def render_workload(reference_sizes: list[list[tuple[int, int]]], variant: str, area: int,
                    condition_area: int) -> Workload:
    """The largest validation render in tokens, batch 1 (the pipelines run the guided and the unguided pass one after
    the other): the target, sized from the edit's last reference as the pipelines size it, and every reference at
    `area` (qwen_edit.inference.area), plus the prompt's bound for the most references. `reference_sizes`: per edit
    the (width, height) of its reference images; [] is a text-to-image sample (square)."""
    from types import SimpleNamespace

    from train.model import conditioning

    def dims(width: int, height: int) -> tuple[int, int]:
        return conditioning.dimensions(area, SimpleNamespace(width=width, height=height))

    best = None
    for sizes in reference_sizes or [[]]:
        refs = [dims(w, h) for w, h in sizes]
        target = refs[-1] if refs else dims(1, 1)
        tokens = sum((w // 16) * (h // 16) for w, h in [target, *refs])
        if best is None or tokens > best[0]:
            best = (tokens, target)
    most = max((len(sizes) for sizes in reference_sizes), default=0)
    tokens, (width, height) = best
    return Workload(1, tokens, (height // 8, width // 8), text_tokens_bound(variant, most, area, condition_area))


def _mini_config(model_dir: Path) -> dict:
    from diffusers import QwenImageTransformer2DModel

    return dict(QwenImageTransformer2DModel.load_config(model_dir / "transformer"))


def _mini_transformer(model_dir: Path, num_layers: int, dtype: torch.dtype, device: torch.device):
    from diffusers import QwenImageTransformer2DModel

    config = _mini_config(model_dir)
    config["num_layers"] = num_layers
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return QwenImageTransformer2DModel.from_config(config)
    finally:
        torch.set_default_dtype(saved)


def _inputs(model, w: Workload, dtype: torch.dtype, device: torch.device) -> dict:
    h, wd = w.target_hw
    target = (h // 2) * (wd // 2)
    refs = w.image_tokens - target
    ref_h = max(1, int(round(math.sqrt(refs)))) if refs else 0
    ref_w = refs // ref_h if refs else 0
    shapes = [(1, h // 2, wd // 2)] + ([(1, ref_h, ref_w)] if refs else [])
    tokens = target + ref_h * ref_w
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(w.batch, tokens, model.config.in_channels, generator=g, device=device, dtype=dtype)
    text = torch.randn(w.batch, w.text_tokens, model.config.joint_attention_dim, generator=g, device=device,
                       dtype=dtype)
    return dict(hidden_states=hidden, timestep=torch.full((w.batch,), 0.5, device=device, dtype=dtype),
                encoder_hidden_states=text, encoder_hidden_states_mask=None, img_shapes=[shapes] * w.batch,
                return_dict=False)


def _run(models: list, inputs: dict, device: torch.device, warmup: int = 2, repeats: int = 5
         ) -> list[tuple[float, float, list[float], list[float]]]:
    """For each model: (kept after forward, peak above that in the backward, forward s and forward+backward s of
    each timed pass), the memory of its last pass. The passes alternate between the models, `warmup` untimed
    rounds (the first compiles) then `repeats` timed ones, so that a drift of the GPU's clocks or of the host's
    load during the measurement reaches every model alike and cancels in the differences measure takes: run one
    model after the other, one H200 measured a v1 block's forward at 6.3 ms and, in the next run, 3.3 ms
    (docs/perf_notes.md M8)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = [[0.0, 0.0, [], []] for _ in models]
    for i in range(warmup + repeats):
        for model, result in zip(models, results, strict=True):
            sync()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss = model(**inputs)[0].float().square().mean()
            sync()
            t1 = time.perf_counter()
            after_fwd = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss.backward()
            sync()
            t2 = time.perf_counter()
            result[0], result[1] = after_fwd - base, torch.cuda.max_memory_allocated(device) - after_fwd
            if i >= warmup:
                result[2].append(t1 - t0)
                result[3].append(t2 - t0)
            del loss
            model.zero_grad(set_to_none=True)
    return [tuple(r) for r in results]


def _median_difference(more: list[float], fewer: list[float]) -> float:
    """The median of the paired differences of two models' timed passes of one round (_run): a block's time."""
    return statistics.median(a - b for a, b in zip(more, fewer, strict=True))


def measure(model_dir: str | Path, w: Workload, dtype: torch.dtype, device: torch.device, mode: str, lora,
            fp8_base: bool, compile_blocks: bool, kept: bool = True, fp8_fast_accum: bool = False) -> Measured:
    """A, S, T and block times at workload `w` from a one- and a two-block transformer, each run plain and
    checkpointed (see the module docstring). With `kept` (and a kernel for it) the checkpointed blocks keep their
    attention output: X (kept_bytes) is counted, S is what the block holds besides it, and the difference of the
    checkpointed and plain block times is a kept block's recomputation. fp8_fast_accum: the fp8 matmuls as
    train.fp8_fast_accum runs them. Seconds, plus compilation."""
    from train.model import components, kept_attention

    model_dir = Path(model_dir)
    keep = kept and kept_attention.available(device, dtype)
    runs = {}
    for checkpointed in (False, True):
        models = []
        for layers in (1, 2):
            model = _mini_transformer(model_dir, layers, dtype, device)
            components.prepare_for_training(model, mode, lora, checkpointed, compile_blocks, fp8_base,
                                            kept_attention_blocks=-1 if keep else 0, fp8_fast_accum=fp8_fast_accum)
            models.append(model.train())
        runs[checkpointed] = _run(models, _inputs(models[0], w, dtype, device), device)
        del models, model
        torch.cuda.empty_cache()
    (k1, t1, f1, b1), (k2, t2, f2, b2) = runs[False]
    (k1c, t1c, _, b1c), (k2c, t2c, _, b2c) = runs[True]
    config = _mini_config(model_dir)
    x = kept_attention.kept_bytes(w.batch, w.image_tokens + w.text_tokens, config["num_attention_heads"],
                                  config["attention_head_dim"], dtype.itemsize) if keep else 0
    act, ckpt = max(k2 - k1, 0.0), max(k2c - k1c - x, 0.0)
    head, head_c = max(k1 - act, 0.0), max(k1c - x - ckpt, 0.0)
    fwd, both = max(_median_difference(f2, f1), 1e-6), max(_median_difference(b2, b1), 1e-6)
    return Measured(act, ckpt, head + max(t1, t2), fwd, both, _h2d_rate(device),
                    ckpt_transient_bytes=head_c + max(t1c, t2c), kept_bytes=x,
                    kept_recompute_s=min(max(_median_difference(b2c, b1c) - both, 0.0), fwd) if keep else None)


def _h2d_rate(device: torch.device, nbytes: int = 1 << 28) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes / max(time.perf_counter() - t0, 1e-9)


def peak_above(device: torch.device, call, repeats: int = 2) -> float:
    """Bytes `call` allocates above what is allocated before it (without gradients; the last of `repeats`, the
    first warms the kernels' workspaces); math.inf when it runs out of memory (it cannot fit the budget)."""
    peak = 0.0
    try:
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                out = call()
            del out
            torch.cuda.synchronize(device)
            peak = float(torch.cuda.max_memory_allocated(device) - base)
    except torch.cuda.OutOfMemoryError:
        peak = math.inf
    torch.cuda.empty_cache()
    return peak


def measure_render(m: Measured, model_dir: str | Path, w: Workload, dtype: torch.dtype, vae_dtype: torch.dtype,
                   device: torch.device, mode: str, lora, fp8_base: bool, online: bool,
                   vae_2d_frames: bool = True) -> Measured:
    """`m` with R and V of the module docstring at the render workload `w`: a one-block transformer prepared as
    training prepares it, eager (the module docstring), run forward without gradients, and the VAE
    decoding a latent of the render's target size, untiled and tiled (online also encoding an image of that size,
    as the render encodes its references; the larger counts), on the path model.vae_2d_frames chooses. A second
    or two."""
    from train.model import components

    forward = _render_forward_bytes(model_dir, w, dtype, device, mode, lora, fp8_base)  # its model freed here
    vae = components.load_vae(model_dir, vae_dtype, device, vae_2d_frames)
    untiled, tiled = (_vae_transient(vae, w, tiling, online) for tiling in (False, True))
    return dataclasses.replace(m, render_forward_bytes=forward, render_vae_bytes=untiled, render_vae_tiled_bytes=tiled)


def _render_forward_bytes(model_dir, w: Workload, dtype, device, mode: str, lora, fp8_base: bool) -> float:
    from train.model import components

    model = _mini_transformer(Path(model_dir), 1, dtype, device)
    components.prepare_for_training(model, mode, lora, False, False, fp8_base)
    model.eval()
    inputs = _inputs(model, w, dtype, device)
    return peak_above(device, lambda: model(**inputs)[0])


def _vae_transient(vae, w: Workload, tiled: bool, online: bool) -> float:
    vae.use_tiling = tiled  # as validation.preserved_training_state sets it for a render
    device, dtype = vae.device, vae.dtype
    h, wd = w.target_hw
    latents = torch.zeros(1, vae.config.z_dim, 1, h, wd, device=device, dtype=dtype)
    decode = peak_above(device, lambda: vae.decode(latents, return_dict=False)[0])
    if not online:
        return decode
    pixels = torch.zeros(1, 3, 1, h * 8, wd * 8, device=device, dtype=dtype)
    return max(decode, peak_above(device, lambda: vae.encode(pixels).latent_dist.mode()))


def budget_bytes(budget_gb: float, device: torch.device) -> float:
    """The memory the run may use: budget_gb, or (0) the device's free memory now; a budget_gb below the device
    caps the process there (torch's per-process fraction), so a smaller card is simulated faithfully."""
    free, total = torch.cuda.mem_get_info(device)
    if budget_gb <= 0:
        return float(free)
    if budget_gb * GB > total:
        raise PlanError(f"qwen_edit.memory.budget_gb: {budget_gb} GB is more than {torch.cuda.get_device_name(device)} "
                        f"has ({total / GB:.1f} GB); lower it or set 0 (the free memory)")
    torch.cuda.set_per_process_memory_fraction(budget_gb * GB / total, device)
    return budget_gb * GB


ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's allocator settings; the user's win


def expandable_segments(device: torch.device) -> str:
    """Turn on torch's expandable segments for the rest of the run, unless the user configured torch's allocator: ""
    when nothing changed, else the plan line's note. Why: at 16 GB the 2509 step ran out of memory with 13.5 GB
    allocated and 2.5 GB cached but free in pieces too small for a 144 MiB request (docs/performance.md "Memory");
    segments that grow in place keep freed memory reusable for any size, torch's own remedy, which its error message
    names. Runs that offload nothing gain headroom too: at 141 GB from the cache the allocator's reserved peak fell
    from 140.1 to 134.1 GB at the same step time (docs/perf_notes.md M15), room a dataset with several shape buckets
    needs. The segments cached so far (the plan's measurement) are released first."""
    if device.type != "cuda" or any(os.environ.get(e) for e in ALLOC_CONF_ENVS):
        return ""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    torch.cuda.empty_cache()
    return ", torch's expandable segments on (PYTORCH_CUDA_ALLOC_CONF set by you would be kept)"


def margin_bytes(margin_gb: float, budget: float) -> float:
    """The headroom kept free: margin_gb, or (0) 1.5 GB + 5% of the budget (NCCL, the checkpoint writer, the
    allocator's fragmentation)."""
    return margin_gb * GB if margin_gb > 0 else 1.5 * GB + 0.05 * budget


def fixed_settings(cfg) -> dict:
    """{dotted key: value} of the plan's knobs that the config sets itself (cfg.explicit), and OFFLOAD_KEY: whether
    the optimizer is offloaded, when the DeepSpeed section says so itself."""
    p = cfg.project
    fixed = {k: getattr(getattr(p, k.split(".")[0]), k.split(".")[1]) for k in PLAN_KEYS if k in cfg.explicit}
    offloaded = configured_offload(cfg.deepspeed)
    if offloaded is not None:
        fixed[OFFLOAD_KEY] = offloaded
    return fixed


def configured_offload(ds: dict) -> bool | None:
    """Whether DeepSpeed's section offloads the optimizer (offload_optimizer.device cpu or nvme, or the deprecated
    cpu_offload); None when it does not say."""
    zero = ds.get("zero_optimization") or {}
    if "offload_optimizer" in zero:
        return (zero["offload_optimizer"] or {}).get("device", "none") in ("cpu", "nvme")
    if "cpu_offload" in zero:
        return bool(zero["cpu_offload"])
    return None


def offload_blocker(ds: dict, s: Sizes, host: Host = Host()) -> str | None:
    """Why DeepSpeed's optimizer offload cannot serve this run (None: it can): the optimizer is not Adam/AdamW
    (DeepSpeedCPUAdam), the ZeRO stage is not 1 or 2, or the host lacks the room for the state (each rank holds
    its 1/world_size partition, host_state_bytes; the same margin as for offloaded blocks)."""
    optimizer = ds.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in OFFLOADABLE_OPTIMIZERS:
        return (f"optimizer.type {json.dumps(optimizer.get('type'))} is not one DeepSpeed steps on the host with "
                "DeepSpeedCPUAdam (Adam, AdamW); use \"AdamW\" to allow it")
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (1, 2):
        return f"zero_optimization.stage is {stage}; DeepSpeed offloads the optimizer of ZeRO stage 1 or 2"
    need = s.host_state_bytes(host.world_size) * host.ranks_per_node
    if need > host.room_bytes:
        return (f"its state needs {need / GB:.1f} GB of host memory on this node and {host.available_bytes / GB:.1f}"
                f" GB is available, less a {host.margin_bytes / GB:.1f} GB margin")
    return None


def apply(cfg, c: Choice, num_blocks: int) -> None:
    """Write the plan's choice into the config's free knobs (explicit ones are already equal or untouched); the
    optimizer offload goes into the DeepSpeed section the engine is built with."""
    p = cfg.project
    if c.offload_optimizer and configured_offload(cfg.deepspeed) is None:
        zero = cfg.deepspeed.setdefault("zero_optimization", {})
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    values = settings(c, num_blocks)
    if c.cached and p.data.cache == "off":
        values["data.cache"] = "auto"
    for dotted, value in values.items():
        if dotted in cfg.explicit:
            continue
        section, name = dotted.split(".")
        setattr(getattr(p, section), name, value)
    if "train.compile" not in cfg.explicit:
        p.train.compile = True
    p.train.fp8_fast_accum = planned_fast_accum(cfg, p.train.fp8_base)


def planned_fast_accum(cfg, fp8_base: bool) -> bool:
    """train.fp8_fast_accum as the plan runs it: the config's value where it sets the key, otherwise on with an fp8
    base (docs/perf_notes.md lever 29)."""
    return cfg.project.train.fp8_fast_accum if "train.fp8_fast_accum" in cfg.explicit else fp8_base


# ---------------------------------------------------------------- the run's plan


def plan_run(cfg, d, variant: str, dataset) -> dict | None:
    """Plan the run's memory (see the module docstring) and write the choice into `cfg`; prints the plan and its
    predicted peak, and returns them for summary.json. None when there is nothing to plan (memory.plan off, no
    GPU, the model-parallel mode); a budget_gb still caps the process then."""
    from train.runtime.metrics import print0, reset_peak_memory

    p = cfg.project
    if d.device.type != "cuda":
        return None
    budget = budget_bytes(p.memory.budget_gb, d.device)
    if p.parallel.mode != "zero2":
        return None
    host = node_host(cfg.world_size)
    if p.memory.plan == "off":
        check_offload_host(cfg, host)  # the config as written: its own offloaded blocks must fit the host
        return None
    t0 = time.perf_counter()
    fixed = fixed_settings(cfg)
    online = p.data.cache == "off"
    keys = dataset.bucket_keys()
    refs = max(len(k) - 1 for k in keys)
    work = largest_bucket(keys, cfg.micro_batch_size, text_tokens_bound(variant, refs, p.data.area,
                                                                          p.data.condition_area))
    dtype = getattr(torch, cfg.precision)
    sizes = run_sizes(cfg, online)
    render = validation_workload(p, variant) if p.validation.file else None
    if render is not None:
        sizes = dataclasses.replace(sizes, vae_bytes=component_bytes(p.model.path, "vae"))
    fp8_ok = p.train.mode == "lora" and torch.cuda.get_device_capability(d.device) >= (8, 9)
    measured = _measure_run(p, d.device, work, render, dtype, fixed, fp8_ok, online,
                            planned_fast_accum(cfg, fixed.get("train.fp8_base", fp8_ok)))
    # One plan for every rank: the smallest budget of any rank, rank 0's measurement (timings differ a little).
    from train.runtime.engine import all_gather_objects

    gathered = all_gather_objects((budget, measured))
    budget, measured = min(b for b, _ in gathered), gathered[0][1]
    margin = margin_bytes(p.memory.margin_gb, budget)
    blocker = offload_blocker(cfg.deepspeed, sizes, host)
    choice, pred = choose(sizes, measured, budget, margin, fixed, fp8_ok, online, blocker, host)
    note = render_note(sizes, measured, choice, pred, budget, margin, fixed, fp8_ok, online, blocker, host)
    apply(cfg, choice, sizes.num_blocks)
    segments = expandable_segments(d.device)
    reset_peak_memory(d.device)  # the run's logged peak starts here, not at the measurement
    tokens = work.batch * (work.image_tokens + work.text_tokens)
    print0(f"memory plan ({time.perf_counter() - t0:.0f} s): budget {budget / GB:.1f} GB, margin {margin / GB:.1f} GB, "
           f"largest micro-batch {tokens} tokens -> {describe(choice, sizes.num_blocks)}"
           f"{', compiled blocks' if p.train.compile else ''}{segments}; predicted peak {pred.peak_bytes / GB:.1f} GB, "
           f"~{pred.step_s:.2f} s per micro-batch in the blocks{_host_note(pred)}{_pinned_note(sizes, choice, host)}"
           f"{note}. Keys set in the config "
           "are kept; qwen_edit.memory.plan = \"off\" runs the config as written", rank=d.rank)
    return {"budget_gb": budget / GB, "margin_gb": margin / GB, "tokens": tokens,
            "host_available_gb": host.available_bytes / GB, "ranks_per_node": host.ranks_per_node,
            "predicted_host_pinned_gb": host_bytes(sizes, choice, host) / GB,
            **_plan_record(choice, pred, sizes, measured, render)}


def offload_share(model_dir: str | Path, lora, blocks: int, fp8_base: bool, dtype_bytes: int):
    """The node's shared host copy (offload.node_share) of the first `blocks` offloaded blocks, sized as host_bytes
    counts them, or None (nothing offloaded, one process, no room in /dev/shm). A collective."""
    if not blocks:
        return None
    from train.model import offload

    sizes = count_sizes(model_dir, lora.target_modules, lora.rank)
    return offload.node_share(blocks * moved_bytes(sizes, fp8_base, dtype_bytes))


def run_sizes(cfg, online: bool) -> Sizes:
    """count_sizes for this run's model and LoRA, with its DeepSpeed ZeRO stage and data-parallel world (how the
    trainable state is split over the ranks) and, online, the encoders that share the GPU and whether they encode
    ahead."""
    p = cfg.project
    sizes = count_sizes(p.model.path, p.lora.target_modules, p.lora.rank,
                        encoder_bytes(p.model.path) if online else 0, p.train.mode == "full")
    stage = (cfg.deepspeed.get("zero_optimization") or {}).get("stage", 0)
    return dataclasses.replace(sizes, zero_stage=stage, dp_world=cfg.world_size,
                               encode_ahead=online and p.data.encode_ahead,
                               accumulating=cfg.deepspeed.get("gradient_accumulation_steps", 1) > 1,
                               **bucket_sizes(cfg.deepspeed))


def bucket_sizes(ds: dict) -> dict:
    """Sizes' bucket fields from a DeepSpeed config: one bucket is reduce_bucket_size gradient elements (bf16; fp32
    where data_types.grad_accum_dtype asks for fp32 accumulation, counted so whether or not DeepSpeed stages it),
    two of them with overlap_comm (off by DeepSpeed's default below stage 3)."""
    zero = ds.get("zero_optimization") or {}
    fp32 = str((ds.get("data_types") or {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32", "float")
    return {"bucket": float(zero.get("reduce_bucket_size", REDUCE_BUCKET_DEFAULT)) * (4 if fp32 else 2),
            "buckets": 2 if zero.get("overlap_comm", False) else 1,
            "contiguous_gradients": bool(zero.get("contiguous_gradients", True))}


def _measure_run(p, device: torch.device, work: Workload, render: Workload | None, dtype: torch.dtype,
                 fixed: dict, fp8_ok: bool, online: bool, fast_accum: bool) -> Measured:
    """This rank's measurement for the plan: the blocks at `work` (an fp8 base's matmuls with fast accumulation when
    `fast_accum`), then online encoding's bytes and the validation render's transients when they apply."""
    measured = measure(p.model.path, work, dtype, device, p.train.mode, p.lora,
                       fixed.get("train.fp8_base", fp8_ok), fixed.get("train.compile", True),
                       fixed.get("train.kept_attention_blocks", -1) != 0, fast_accum)
    if online:
        measured = _with_encode_bytes(measured, p, device, work)
    if render is not None:
        from train.model import components

        measured = measure_render(measured, p.model.path, render, dtype,
                                  components.encoder_dtype(p.model.encoder_dtype, device), device, p.train.mode,
                                  p.lora, fixed.get("train.fp8_base", fp8_ok), online, p.model.vae_2d_frames)
    return measured


def _plan_record(choice: Choice, pred: Prediction, sizes: Sizes, measured: Measured, render: Workload | None) -> dict:
    """The chosen settings, predictions and measurements as summary.json records them."""
    return {"choice": describe(choice, sizes.num_blocks), "predicted_peak_gb": pred.peak_bytes / GB,
            "offload_optimizer": choice.offload_optimizer, "predicted_host_step_s": pred.optimizer_s,
            "render_tokens": render and render.image_tokens + render.text_tokens,
            "predicted_render_peak_gb": pred.render_peak_bytes / GB if render else None,
            "vae_tiling": choice.vae_tiling,
            "measured": {k: None if isinstance(v, float) and math.isinf(v) else v  # inf: did not fit alone
                         for k, v in measured.__dict__.items()}}


def validation_workload(p, variant: str) -> Workload:
    """render_workload of validation.file's edits at the inference section's areas (the images' headers read)."""
    from train.model import images, pipelines

    requests, _ = pipelines.read_requests(p.validation.file, p.train.seed)
    sizes = [[images.shown_size(path) for path in q.references] for q in requests]
    return render_workload(sizes, variant, p.inference.area, p.inference.condition_area)


def _host_note(pred: Prediction) -> str:
    if not pred.optimizer_s:
        return ""
    return (f", plus ~{pred.optimizer_s:.1f} s per optimizer step on the host (DeepSpeedCPUAdam; an allowance, "
            "docs/performance.md 'The last resort'): zero_optimization.offload_optimizer was the only way to fit")


def _pinned_note(s: Sizes, c: Choice, host: Host) -> str:
    pinned = host_bytes(s, c, host)
    if not pinned:
        return ""
    shared = " in one copy in /dev/shm" if host.shares(c.offloaded * moved_bytes(s, c.fp8_base)) else ""
    return (f", {pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es)"
            f"{shared}), of {host.available_bytes / GB:.1f} GB available")


def _host_available() -> float:
    import psutil  # a dependency of DeepSpeed's

    return float(psutil.virtual_memory().available)


def node_host(world_size: int) -> Host:
    """This node's Host: the smallest available host memory any rank sees (a collective, so that every rank plans
    alike) and the processes per node from the launcher's environment."""
    from train.model.offload import shm_free_bytes
    from train.runtime.engine import all_gather_objects

    seen = all_gather_objects((_host_available(), shm_free_bytes()))
    return Host(min(a for a, _ in seen), _ranks_per_node(), world_size, min(f for _, f in seen))


def check_offload_host(cfg, host: Host) -> None:
    """PlanError, before anything loads, when the config's own train.offload_blocks (with its fp8_base and
    DeepSpeed's optimizer offload as written) does not fit this node's host memory."""
    p = cfg.project
    if not p.train.offload_blocks:
        return
    s = count_sizes(p.model.path, p.lora.target_modules, p.lora.rank, 0, p.train.mode == "full")
    k = min(p.train.offload_blocks, s.num_blocks)
    c = Choice(p.train.fp8_base, False, k, k, True, bool(configured_offload(cfg.deepspeed)))
    if not fits_host(s, c, host):
        raise PlanError(f"qwen_edit.train.offload_blocks = {p.train.offload_blocks} does not fit this node's host "
                        f"memory: the offloaded blocks need "
                        f"{host_refusal(s, c, host, {'train.offload_blocks': p.train.offload_blocks})}")


def _ranks_per_node() -> int:
    env = os.environ
    return int(env.get("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))


def _with_encode_bytes(m: Measured, p, device: torch.device, work: Workload) -> Measured:
    """Add the encoders' transient while encoding online (see encode_transient)."""
    return dataclasses.replace(m, encode_bytes=encode_transient(p.model.path, device, work, p.model.vae_2d_frames))


def encode_transient(model_dir: str | Path, device: torch.device, work: Workload, vae_2d_frames: bool = True) -> float:
    """Bytes an encode allocates above the encoders' weights: the VAE encoding the largest target of `work` at its
    size, measured (the peak of the two), plus VL_ACTIVATION_BYTES for the VL model's activations (a few thousand
    tokens without gradients: far smaller). vae_2d_frames: the VAE's path (model.vae_2d_frames); diffusers' own
    keeps a copy of every layer's input for a next chunk, ~1.5 GB more at 1 MP."""
    from train.model import components

    vae = components.load_vae(model_dir, torch.bfloat16, device, vae_2d_frames)
    h, w = work.target_hw
    pixels = torch.zeros(work.batch, 3, 1, h * 8, w * 8, device=device, dtype=torch.bfloat16)
    peak = peak_above(device, functools.partial(vae.encode, pixels), repeats=1)
    del vae, pixels
    torch.cuda.empty_cache()
    return peak + VL_ACTIVATION_BYTES


# ---------------------------------------------------------------- the cache build's encoders


def stream_vl_for_cache(cfg, d, bucket_keys) -> bool:
    """Whether the cache build streams Qwen2.5-VL's blocks from pinned host memory (components.stream_from_host:
    two device slots per block list, the next block prefetched) instead of holding it on the GPU: see
    cache_vl_decision. Measures the
    VAE's largest encode; prints a streamed decision. Never on a CPU, nor with memory.plan "off" (the config as
    written)."""
    from train.runtime.metrics import print0

    p = cfg.project
    if d.device.type != "cuda" or p.memory.plan == "off":
        return False
    budget = budget_bytes(p.memory.budget_gb, d.device)
    room = budget - margin_bytes(p.memory.margin_gb, budget) - torch.cuda.memory_allocated(d.device)
    largest = max((hw for key in bucket_keys for hw in key), key=lambda hw: hw[0] * hw[1])  # target or reference
    need = {"vl": component_bytes(p.model.path, "text_encoder"), "vae": component_bytes(p.model.path, "vae"),
            "encode": encode_transient(p.model.path, d.device, Workload(1, 0, largest, 0), p.model.vae_2d_frames)}
    host = node_host(cfg.world_size)  # a collective: every rank takes part, whatever its own decision
    if need["vl"] + need["vae"] + need["encode"] <= room:
        return False
    need["streamed"] = streamed_vl_bytes(p.model.path)
    line = cache_vl_decision(need, room, budget, host)
    print0(line, rank=d.rank)
    return True


def cache_vl_decision(need: dict[str, float], room: float, budget: float, host: Host) -> str:
    """The cache build's line when Qwen2.5-VL (need["vl"]) + the VAE + the largest encode do not fit `room` (the
    budget less the margin): streamed, it holds need["streamed"] on the GPU and each process pins its copy in host
    memory. PlanError, before any encoder loads, when that does not fit either."""
    pinned = need["vl"] * host.ranks_per_node
    figures = (f"Qwen2.5-VL {need['vl'] / GB:.1f} GB + VAE {need['vae'] / GB:.1f} GB + the largest encode "
               f"{need['encode'] / GB:.1f} GB do not fit the {room / GB:.1f} GB that qwen_edit.memory.budget_gb "
               f"{budget / GB:.1f} leaves after the margin")
    if need["streamed"] + need["vae"] + need["encode"] > room or pinned > host.room_bytes:
        raise PlanError(f"the latent cache cannot be built within the memory budget: {figures}, and streamed from "
                        f"host memory Qwen2.5-VL needs {need['streamed'] / GB:.1f} GB on the GPU and "
                        f"{pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es); "
                        f"{host.available_bytes / GB:.1f} GB available). Build the cache on a larger GPU with "
                        "python -m train.cache (the same config and dataset), raise budget_gb, or lower "
                        "qwen_edit.data.area")
    return (f"latent cache: {figures}, so Qwen2.5-VL is streamed block by block from {pinned / GB:.1f} GB of pinned "
            f"host memory (the project's block offloader; {need['streamed'] / GB:.1f} GB of it on the GPU at a time)")


def streamed_vl_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Qwen2.5-VL's bytes on the GPU while its blocks stream from host memory (components.stream_from_host): all
    but the blocks' matrices (embeddings, lm_head, the ViT's patch embedding and merger, every vector) plus two
    device slots per block list, each the size of its largest block's matrices; counted from its config on the
    meta device."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(Path(model_dir) / "text_encoder"))
    moved, slots = 0, 0
    for blocks in (model.model.visual.blocks, model.model.language_model.layers):
        sizes = [sum(t.numel() for t in b.parameters() if t.dim() >= 2) for b in blocks]  # offload.moves
        moved, slots = moved + sum(sizes), slots + 2 * max(sizes)
    return (sum(t.numel() for t in model.parameters()) - moved + slots) * dtype_bytes


# ---------------------------------------------------------------- out of memory


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory in a phase of the run; the message names the settings that lower that phase's memory.
    Entry points print it without a traceback (engine.exit_with)."""

    without_traceback = True


_LOWER = {
    "load": ("qwen_edit.memory.plan \"auto\" (the default; do not pin train.fp8_base / offload_blocks / "
             "gradient_checkpointing in the config) or, by hand, train.fp8_base = true and train.offload_blocks = N "
             "(with train.gradient_checkpointing = true); data.cache \"auto\" so the encoders leave the GPU before the "
             "transformer loads; a lower qwen_edit.memory.budget_gb if other processes share the GPU"),
    "encode": ("data.cache \"auto\" (the encoders run once, before the transformer loads, and leave the GPU), a "
               "smaller qwen_edit.data.area or data.condition_area"),
    "cache": ("a smaller qwen_edit.data.area or data.condition_area (the largest image's encode), a larger "
              "qwen_edit.memory.margin_gb or a lower memory.budget_gb (below what Qwen2.5-VL and the VAE need, "
              "Qwen2.5-VL's blocks stream from host memory), or build the cache with python -m train.cache on a "
              "larger GPU and point data.cache_dir at it; the rows encoded so far are rewritten on the next run"),
    "step": ("qwen_edit.train.gradient_checkpointing = true (checkpoint_blocks 0 = every block), "
             "train.offload_blocks = N (the first N blocks' frozen weights in host memory), train.fp8_base = true, "
             "a smaller qwen_edit.data.area, a lower qwen_edit.lora.rank, or memory.plan \"auto\" with those keys "
             "left out of the config; last, zero_optimization.offload_optimizer = {\"device\": \"cpu\"} (the "
             "optimizer state in host memory, a slower step)"),
    "validation": ("inference.vae_tiling = true (the VAE decodes in tiles), a smaller qwen_edit.inference.area, "
                   "data.cache \"auto\" (renders then replay conditioning recorded before the model loads, with "
                   "the VAE alone: no VL encoder beside the model), or validation.file \"\" and render the export "
                   "afterwards with python -m train.infer"),
}


@dataclass(frozen=True)
class InEffect:
    """A run's memory settings as it trains (after the plan), for the step's out-of-memory advice."""

    checkpoint_all: bool  # train.gradient_checkpointing on every block
    offload_blocks: int
    fp8_base: bool
    offload_optimizer: bool  # DeepSpeed's zero_optimization.offload_optimizer
    planned: bool  # qwen_edit.memory.plan "auto" chose them
    margin_gb: float  # qwen_edit.memory.margin_gb (0: automatic)


def _step_advice(now: InEffect) -> str:
    """The step's levers that are not yet in effect, then what is left when the plan already pulled them all."""
    items = [] if now.checkpoint_all else [
        "qwen_edit.train.gradient_checkpointing = true (checkpoint_blocks 0 = every block)"]
    items.append(f"train.offload_blocks = N (the first N blocks' frozen weights in host memory; now "
                 f"{now.offload_blocks})")
    if not now.fp8_base:
        items.append("train.fp8_base = true")
    items += ["a smaller qwen_edit.data.area", "a lower qwen_edit.lora.rank"]
    if now.planned:
        margin = f"now {now.margin_gb:g} GB" if now.margin_gb > 0 else "now automatic: 1.5 GB + 5% of the budget"
        items.append(f"a larger qwen_edit.memory.margin_gb ({margin}): the plan then picks a setting with a "
                     "smaller predicted peak")
    else:
        items.append("memory.plan \"auto\" with those keys left out of the config")
    advice = ", ".join(items)
    if not now.offload_optimizer:
        advice += ("; last, zero_optimization.offload_optimizer = {\"device\": \"cpu\"} (the optimizer state in host "
                   "memory, a slower step)")
    return advice


def oom_advice(phase: str, micro_batch: int, now: InEffect | None = None) -> str:
    """What lowers the memory of `phase` (load, encode, cache, step, validation); a micro-batch of 1 is never suggested
    to a run that already has it, nor (with `now`, the step's settings in effect) a step setting already on."""
    micro = ("; train_micro_batch_size_per_gpu = 1 (raise gradient_accumulation_steps instead)"
             if micro_batch > 1 and phase in ("encode", "step") else "")
    lower = _step_advice(now) if phase == "step" and now is not None else _LOWER[phase]
    return f"To use less memory: {lower}{micro}"


def out_of_memory(e: BaseException, doing: str, phase: str, micro_batch: int = 1) -> OutOfMemory:
    """The OutOfMemory to raise from torch's error `e` in `phase`: "CUDA out of memory while <doing>", torch's
    figures, then what lowers that phase's memory."""
    return OutOfMemory(f"CUDA out of memory while {doing}{torch_oom_figures(e)}. {oom_advice(phase, micro_batch)}")


def torch_oom_figures(e: BaseException) -> str:
    """torch's own figures from a CUDA out-of-memory error, shortened: what it tried to allocate, what its caching
    allocator held (allocated, and reserved but free) and the largest allocated so far; "" where it gave none."""
    import re

    text = str(e)
    wanted = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    held = re.search(r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch, and ([\d.]+ [KMGT]?i?B) is reserved by PyTorch but "
                     r"unallocated", text)
    parts = [f"tried to allocate {wanted.group(1)}"] if wanted else []
    if held:
        parts.append(f"{held.group(1)} allocated and {held.group(2)} reserved but free")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(f"at most {torch.cuda.max_memory_allocated() / GB:.1f} GB allocated so far")
    return f" (torch: {'; '.join(parts)})" if parts else ""


# ---------------------------------------------------------------- inference


# An allowance, not a measurement: a no-grad transformer pass at ~1 MP plus the VAE decode (train.infer's
# placement has not been measured on a GPU).
INFERENCE_ACTIVATION_BYTES = 6 * GB  # one transformer pass and the VAE's decode, up to INFERENCE_TOKENS
INFERENCE_TOKENS = 12_500  # 1 MP with two references: 1.5 GB measured above the models (docs/performance.md)


def inference_allowance(tokens: int) -> float:
    """What train.infer's plan keeps beside the models for a pass and the decode: INFERENCE_ACTIVATION_BYTES up to
    INFERENCE_TOKENS image tokens, in proportion above (both grow with the tokens and the area)."""
    return INFERENCE_ACTIVATION_BYTES * max(1.0, tokens / INFERENCE_TOKENS)


def inference_tokens(most_references: int, area: int) -> int:
    """A bound on a render's image tokens: the target and every reference at `area` pixels, 16 x 16 pixels a token
    (the VAE's 8x and the transformer's 2x2 patches)."""
    return (1 + most_references) * area // 256


@dataclass
class InferencePlacement:
    """train.infer's placement: inference.cpu_offload, and for "blocks" how many of the transformer's first blocks
    keep their matrices in pinned host memory and whether Qwen2.5-VL streams block by block while it encodes."""

    cpu_offload: str
    offload_blocks: int = 0
    stream_text_encoder: bool = False


def inference_placement(parts: dict[str, float], block_bytes: float, num_blocks: int, budget: float, margin: float,
                        streamed_vl: float = 0.0, host: Host = Host(), tokens: int = 0) -> InferencePlacement:
    """train.infer's placement for a budget. parts: bytes of "transformer", "text encoder" and "VAE".

    "none" when every model fits on the GPU at once with inference_allowance(tokens) beside them. Else "blocks": the
    encoders run first for a chunk of rows (the conditioning recorded, as validation replays it) and leave the GPU, then
    the transformer runs with its first blocks streamed from pinned host memory by the project's offloader (two
    device slots), as few as the room allows; Qwen2.5-VL itself streams (`streamed_vl` bytes on the GPU) when it
    does not fit whole. "sequential" (diffusers, layer by layer) when not even that fits. PlanError when the pinned
    host copies (each process its own: the streamed Qwen2.5-VL while encoding, then the streamed blocks) do not fit
    `host`."""
    room = budget - margin - inference_allowance(tokens)
    if sum(parts.values()) <= room:
        return InferencePlacement("none")
    vl, vae = parts["text encoder"], parts["VAE"]
    stream = vl + vae > room
    fixed = parts["transformer"] - num_blocks * block_bytes + vae  # embeddings, norms, output layer; the VAE
    if (stream and streamed_vl + vae > room) or fixed + 2 * block_bytes > room:
        return InferencePlacement("sequential")
    if fixed + num_blocks * block_bytes <= room:
        return InferencePlacement("blocks", 0, stream)
    resident = int((room - fixed - 2 * block_bytes) // block_bytes)
    placed = InferencePlacement("blocks", num_blocks - resident, stream)
    pinned = host.ranks_per_node * max(vl if stream else 0.0, placed.offload_blocks * block_bytes)
    if pinned > host.room_bytes:
        raise PlanError(f"train.infer: the models ({sum(parts.values()) / GB:.1f} GB) do not fit the "
                        f"{budget / GB:.1f} GB budget, and streaming them ({describe_placement(placed)}) needs "
                        f"{pinned / GB:.1f} GB of pinned host memory on this node ({host.ranks_per_node} process(es)), "
                        f"{host.room_bytes / GB:.1f} GB of the {host.available_bytes / GB:.1f} GB available after the "
                        "margin. Raise qwen_edit.memory.budget_gb (a larger GPU), start fewer processes per node, or "
                        "free host memory")
    return placed


def plan_inference(model_dir: str | Path, settings, explicit: set[str], device: torch.device, host: Host = Host(),
                   most_references: int = 1) -> tuple[str | None, InferencePlacement]:
    """Set settings.inference.cpu_offload from the budget (memory.budget_gb, or the free memory) unless the
    --config sets it or memory.plan is off; returns (the line to print or None, the placement). With
    cpu_offload "blocks" (planned or set) the placement says how many blocks stream. A budget caps the process.
    most_references: the most references a row of the input has (the render's tokens grow with them)."""
    chosen = InferencePlacement(settings.inference.cpu_offload)
    if device.type != "cuda":
        return None, chosen
    budget = budget_bytes(settings.memory.budget_gb, device)
    margin = margin_bytes(settings.memory.margin_gb, budget)
    sizes = count_sizes(model_dir, [], 0)
    parts = {"transformer": (sizes.num_blocks * sizes.block_params + sizes.other_params) * 2,
             "text encoder": component_bytes(model_dir, "text_encoder"), "VAE": component_bytes(model_dir, "vae")}
    block = sizes.block_params * 2
    streamed = streamed_vl_bytes(model_dir)
    tokens = inference_tokens(most_references, settings.inference.area)
    planned = inference_placement(parts, block, sizes.num_blocks, budget, margin, streamed, host, tokens)
    figures = (f"memory plan: budget {budget / GB:.1f} GB, models {sum(parts.values()) / GB:.1f} GB (transformer "
               f"{parts['transformer'] / GB:.1f} GB)")
    if settings.memory.plan == "off" or "inference.cpu_offload" in explicit:
        if chosen.cpu_offload != "blocks":
            return None, chosen
        # set by the config: as the plan would stream them, none when everything fits, all when nothing would
        chosen = {"none": InferencePlacement("blocks", 0, False),
                  "sequential": InferencePlacement("blocks", sizes.num_blocks, True)}.get(planned.cpu_offload, planned)
        return f"{figures}, inference.cpu_offload \"blocks\" from --config: {describe_placement(chosen)}", chosen
    settings.inference.cpu_offload = planned.cpu_offload
    how = f": {describe_placement(planned)}" if planned.cpu_offload == "blocks" else ""
    return (f"{figures} -> inference.cpu_offload = \"{planned.cpu_offload}\"{how} (set it in --config to choose "
            "yourself)"), planned


def describe_placement(p: InferencePlacement) -> str:
    if p.cpu_offload != "blocks":
        return ""
    vl = "Qwen2.5-VL streamed block by block" if p.stream_text_encoder else "Qwen2.5-VL on the GPU"
    return (f"the encoders first for each chunk of rows ({vl}), then the transformer with its first {p.offload_blocks} "
            "blocks streamed from pinned host memory")
