"""Sizes counted: the transformer's parameters by kind (a block's, the matrices offloading moves, the linears an fp8
base stores in e4m3), the trainable parameters and what DeepSpeed keeps per trainable parameter on each GPU and on
the host, the gradient buckets, and the pinned host bytes of an offloaded block. Counted from the model's config on
the meta device: nothing is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from train.plan import arch

GB = 1e9
# DeepSpeed's bytes on each GPU per trainable parameter, bf16 mixed precision with Adam over a data-parallel world
# of W ranks (state_bytes_per_param; counted from deepspeed/runtime/zero/stage_1_and_2.py and checked against its
# live buffers on the CPU in tests/test_plan_deepspeed.py). While the backward runs: the bf16 weight 2 (a LoRA
# parameter's; a full fine-tune's is counted with the model's), its bf16 gradient 2 (stage 2 keeps only its 1/W
# partition once a bucket is reduced; stage 1 holds every gradient until the backward's end), the fp32 master 4 and
# the two Adam moments 8, split over the ranks by ZeRO stages 1 and 2 (stage 0 keeps all of them on every rank). In
# the step, after the activations are gone, stages 1 and 2 hold the bf16 gradient partition, its flattened copy and
# its fp32 copy at once (8/W), beside the master and moments: 2 + 20/W. Plus DeepSpeed's gradient buckets
# (Sizes.bucket_bytes).
WEIGHT_BYTES = 2
MASTER_AND_MOMENTS_BYTES = 12
STEP_GRAD_BYTES = 8  # the step's bf16 gradient partition + its flattened copy + its fp32 copy
STAGE0_STEP_BYTES = 20  # stage 0 (DeepSpeed's bf16 optimizer): weight, bf16 and fp32 gradients, master, moments
# With DeepSpeed's optimizer offload the master, moments and fp32 gradients are in host memory: a LoRA parameter
# keeps its bf16 weight on the GPU, and its bf16 gradient only at stage 1 (stage 2 hands each reduced bucket to the
# host and frees its gradients). The host holds 18 bytes per parameter, 10 of them pinned by torch, which rounds each
# allocation up to a power of two (optimizer_host_bytes).
BUCKET_BYTES = 2e8 * 2  # one bucket of the shipped configs' reduce_bucket_size (2e8 bf16 elements): Sizes' default
REDUCE_BUCKET_DEFAULT = 5e8  # DeepSpeed's reduce_bucket_size when the config leaves it out


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
    encoder_bytes: int = 0  # the text encoder + VAE in their dtype, when they share the GPU (online encoding)
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
    fp32_buckets: bool = False  # data_types.grad_accum_dtype fp32: the buckets hold fp32 gradients (bucket_sizes)

    def bucket_bytes(self, offload_optimizer: bool) -> float:
        """DeepSpeed's gradient buckets on each GPU from the backward's start to the step (ZeRO stages 1 and 2 with
        contiguous gradients, which its optimizer offload always turns on; stage 0 has none): a hook copies each
        gradient into the bucket that is filling, with overlap_comm a second one is reduced meanwhile."""
        if self.zero_stage not in (1, 2) or not (self.contiguous_gradients or offload_optimizer):
            return 0.0
        return self.bucket * self.buckets

    def unreduced_partition_bytes(self, offload_optimizer: bool, blocks_done: int) -> float:
        """The bytes of gpu_state_bytes not yet allocated at a peak of the backward reached once it has made the
        gradients of the layers outside the blocks (they come first) and of `blocks_done` blocks: ZeRO stage 2's bf16
        gradient partition. DeepSpeed allocates it when it reduces its first bucket (copy_grads_in_partition), that is
        once the gradients made exceed one bucket's elements, and otherwise in the backward's epilogue, after the
        activations are gone. LoRA's gradients of a few blocks fill no 2e8-element bucket, so the backward's
        activation peaks, which come in its first blocks, meet no partition. Counted as present (0 returned) where
        it may be: other stages, the optimizer offload, gradient accumulation (the partition outlives a
        micro-batch), buckets off or in fp32."""
        if (self.zero_stage != 2 or offload_optimizer or self.accumulating or not self.contiguous_gradients
                or self.fp32_buckets):
            return 0.0
        if self.full:
            per_block, outside = self.block_params, self.other_params
        else:  # the family's LoRA targets are the blocks' linears
            per_block, outside = self.lora_params / self.num_blocks, 0
        if outside + blocks_done * per_block > self.bucket / WEIGHT_BYTES:
            return 0.0
        return self.trainable_params * WEIGHT_BYTES / self.dp_world

    def host_state_bytes(self, world_size: int) -> float:
        """optimizer_host_bytes of one rank, with the accumulation buffers when the run accumulates."""
        return optimizer_host_bytes(
            self.trainable_params, world_size, self.accumulation_pinned if self.accumulating else 0
        )

    @property
    def trainable_params(self) -> int:
        return self.num_blocks * self.block_params + self.other_params if self.full else self.lora_params

    @property
    def state_bytes(self) -> float:
        return self.gpu_state_bytes(offload_optimizer=False)

    def gpu_state_bytes(self, offload_optimizer: bool, in_step: bool = False) -> float:
        """The trainable parameters' bytes on each GPU beyond the model's weights while the backward runs (or, with
        `in_step`, in the optimizer step), with or without DeepSpeed's optimizer offload."""
        return self.trainable_params * state_bytes_per_param(
            self.full, self.zero_stage, self.dp_world, offload_optimizer, in_step
        )


def state_bytes_per_param(full: bool, stage: int, world: int, offload_optimizer: bool, in_step: bool = False) -> float:
    """Bytes per trainable parameter on each of `world` GPUs under ZeRO `stage` (the comment at WEIGHT_BYTES): at the
    backward's peak, or with `in_step` in the optimizer step (no activations then). A full fine-tune's weight is
    counted with the model's, so it is left out here."""
    own_weight = 0 if full else WEIGHT_BYTES
    grad = WEIGHT_BYTES / world if stage == 2 else WEIGHT_BYTES
    if offload_optimizer:  # DeepSpeed offloads at stage 1 or 2 only (run_plan.optimizer_offload_blocker)
        # Stage 2 copies each reduced bucket's gradients to the host and frees them there and then
        # (copy_grads_in_partition; DeepSpeed turns contiguous_gradients on whenever it offloads, whatever the
        # config says): only the bucket stays, counted apart. Stage 1 reduces once the backward has ended, so every
        # bf16 gradient exists until then.
        return own_weight + (0 if stage == 2 else WEIGHT_BYTES)
    if stage == 0:
        return (STAGE0_STEP_BYTES if in_step else WEIGHT_BYTES + WEIGHT_BYTES + MASTER_AND_MOMENTS_BYTES) - (
            WEIGHT_BYTES - own_weight
        )
    if in_step:
        return own_weight + (MASTER_AND_MOMENTS_BYTES + STEP_GRAD_BYTES) / world
    return own_weight + grad + MASTER_AND_MOMENTS_BYTES / world


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


def optimizer_host_bytes(trainable_params: int, world_size: int, accumulation_pinned: float = 0) -> float:
    """Host bytes of DeepSpeed's optimizer offload on one rank (ZeRO 1 or 2, pin_memory, the trainer's one parameter
    group; deepspeed/runtime/zero/stage_1_and_2.py): the rank's partition of n parameters has its fp32 master weights
    (4n), fp32 gradients (4n) and a bf16 copy for the updated weights (2n) in three pinned tensors, each rounded up
    to a power of two (pinned_bytes), and the two Adam moments (8n) in ordinary memory (the optimizer makes them
    with zeros_like). Counting a flat 18 bytes per parameter misses the rounding: 110.8 GB for a full fine-tune of
    18 blocks, where the rounded buffers take 135 GB. With gradient_accumulation_steps > 1 DeepSpeed also pins a bf16
    gradient for each parameter of the partition, each its own tensor (async_accumulate_grad_in_cpu_via_gpu):
    `accumulation_pinned`, those of the whole model as torch pins them (trainable_pinned_bf16), of which a rank holds
    its share."""
    n = trainable_params / world_size
    return 2 * pinned_bytes(4 * n) + pinned_bytes(2 * n) + 8 * n + accumulation_pinned / world_size


def trainable_pinned_bf16(numels) -> int:
    """Host bytes of one pinned bf16 tensor per trainable parameter of these sizes (each rounded up to a power of
    two by torch's pinned allocator): DeepSpeed's gradient accumulation buffers under optimizer offload."""
    return sum(pinned_bytes(2 * n) for n in numels)


def bucket_sizes(ds: dict) -> dict:
    """Sizes' bucket fields from a DeepSpeed config: one bucket is reduce_bucket_size gradient elements (bf16; fp32
    where data_types.grad_accum_dtype asks for fp32 accumulation, counted so whether or not DeepSpeed stages it),
    two of them with overlap_comm (off by DeepSpeed's default below stage 3)."""
    zero = ds.get("zero_optimization") or {}
    fp32 = str((ds.get("data_types") or {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32", "float")
    return {
        "bucket": float(zero.get("reduce_bucket_size", REDUCE_BUCKET_DEFAULT)) * (4 if fp32 else 2),
        "buckets": 2 if zero.get("overlap_comm", False) else 1,
        "contiguous_gradients": bool(zero.get("contiguous_gradients", True)),
        "fp32_buckets": fp32,
    }


def count_sizes(
    model_dir: str | Path, target_modules: list[str], rank: int, encoders_on_gpu: int = 0, full: bool = False
) -> Sizes:
    """Sizes of the transformer of `model_dir`, counted on the meta device (nothing is allocated); LoRA of `rank` on
    `target_modules`; `encoders_on_gpu`: the encoders' bytes when they share the GPU."""
    model = arch.empty_transformer(model_dir)
    blocks = arch.transformer_blocks(model)
    block = blocks[0]
    block_params = sum(t.numel() for t in block.parameters())
    matrices = sum(t.numel() for t in block.parameters() if t.dim() >= 2)
    fp8_params = token = 0
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = arch.fp8_kind_in_block(model, name)
            fp8_params += module.weight.numel() if kind else 0
            token += module.weight.numel() if kind == "token" else 0
    lora, lora_numels = 0, []
    for module in arch.lora_linears(model, target_modules):
        lora += rank * (module.in_features + module.out_features)
        lora_numels += [rank * module.in_features, rank * module.out_features]  # lora_A, lora_B
    total = sum(t.numel() for t in model.parameters())
    n = len(blocks)
    numels = [t.numel() for t in model.parameters()] if full else lora_numels
    return Sizes(
        n,
        block_params,
        matrices,
        fp8_params,
        token,
        total - n * block_params,
        0 if full else lora,
        encoders_on_gpu,
        full=full,
        accumulation_pinned=trainable_pinned_bf16(numels),
    )
