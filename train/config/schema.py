"""The configuration's schema: one pydantic dataclass per section of the project's `qwen_edit` JSON section, each
field with its type, its default, its allowed values (a Literal) and its docstring, which pydantic keeps as the
field's description (the help a problem with the field quotes; field_docs gives them to docs/configuration.md,
which train/config/reference.py generates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Literal

import pydantic
import pydantic.dataclasses

PROJECT_KEY = "qwen_edit"


class ConfigError(ValueError):
    """A user mistake in the configuration; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


# How pydantic reads the project section (train/config/load.py): each JSON type as written (no "8" -> 8, 8.0 -> 8
# or 1 -> true; an integer is a float), no unknown key, no NaN/Infinity, and the docstring under each field kept
# as its description.
SCHEMA = pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
section = pydantic.dataclasses.dataclass(config=SCHEMA)


@section
class ModelConfig:
    path: str = ""
    """Local diffusers-format directory of Qwen-Image-Edit, -2509, -2511, Qwen-Image or Qwen-Image-2.1
    (model_index.json inside). CLI: --model."""
    variant: Literal["auto", "edit", "edit_plus", "edit_plus_2511", "t2i", "qwen_image_21"] = "auto"
    """auto reads model_index.json and transformer/config.json; edit = v1 (one reference), edit_plus = 2509
    (1-3 references), edit_plus_2511 = 2511 (2509 with zero_cond_t), t2i = Qwen-Image / 2512 (no reference),
    qwen_image_21 = Qwen-Image-2.1 (QwenImage21Pipeline: 0-10 references, RGB or RGBA); an explicit value must match
    the files."""
    encoder_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of the frozen VL encoder and VAE; auto = bfloat16 on GPU, float32 on CPU."""
    vae_2d_frames: bool = True
    """The VAE runs an image (a video of one frame) as 2D convolutions: each causal 3x3x3 convolution's two taps on
    zero padding are skipped and the video chunk cache is not kept, so an encode is faster and needs less memory.
    The same function as diffusers' (equal within 1e-5 in float32; train/model/qwen_image/vae_frames.py), for online
    encoding, the cache build, validation and train.infer. false = diffusers' own path."""


@section
class DataConfig:
    path: str = ""
    """Directory with metadata.jsonl or metadata.csv and the images it names. CLI: --data."""
    area: int = 1024 * 1024
    """Pixel area targets and VAE copies of references are resized to (aspect kept, sides multiples of 32)."""
    condition_area: int = 384 * 384
    """Pixel area of the copies the VL encoder sees (2509 only; v1 shows it the VAE copy)."""
    alpha_background: str = "white"
    """Colour that transparent pixels (RGBA, LA, palette or tRNS transparency) are composited over, for training,
    the latent cache, validation and train.infer: a name ("white", "black") or "#rrggbb"."""
    bad_rows: Literal["stop", "skip"] = "stop"
    """What to do when the pre-flight check finds bad rows: stop with the report, or skip them (reported)."""
    rows_without_reference: Literal["stop", "text_to_image"] = "stop"
    """Rows without edit_image on an edit model (v1, 2509, 2511): stop names them before step 1 (a misspelt or
    missing reference column would otherwise train every row without its reference); text_to_image trains them as
    text-to-image samples (no reference, QwenImagePipeline's prompt template). Qwen-Image (t2i) takes only such
    rows, and Qwen-Image-2.1 (one model for both) takes them as they come."""
    ignore_columns: list[str] = field(default_factory=list)
    """Columns of metadata.jsonl / metadata.csv that the trainer leaves unread (ids, notes of your own): any other
    column than image, edit_image, prompt and category stops the run before step 1, naming it and the known
    column it is closest to."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host memory of batches (ignored on CPU)."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by train.seed and the epoch; off = a fixed order; see train/data/sampling.py)."""
    cache: Literal["off", "auto", "require"] = "off"
    """Precomputed latents and prompt embeddings: off encodes online; auto builds the cache when it is missing
    (as python -m train.cache does) and trains from it; require trains from it and stops when it is missing.
    Both refuse a stale cache (built for another model, area, template, data ...) with the reason."""
    cache_dir: str = ""
    """Where the cache lives (on a file system every node sees); "" = OUTPUT/cache."""
    encode_ahead: bool | Literal["auto"] = "auto"
    """Online encoding (data.cache off) in the zero2 mode: a background thread encodes the next micro-batch with the
    frozen encoders, on their own CUDA stream, while the transformer trains on this one, so the encoders' time
    overlaps the step and most of it is hidden (the same micro-batches in the same order). It costs memory: the
    memory plan adds the encode's transient to the step's activations. auto = on when training on a GPU, off on
    the CPU, where the thread and the step would share the same cores; false = each micro-batch is encoded right
    before its step. The model-parallel encoder stage always runs ahead."""
    buckets: bool = True
    """Group samples by target and reference shapes so every micro-batch has one shape (micro-batch > 1)."""
    bucket_aspect_steps: int = 8
    """With micro-batch > 1: aspect ratios are snapped to the nearest of 2^(k / N) for whole k, N = this (8: 1,
    1.09, 1.19, 1.30, 1.41, ..., 9% apart), a fixed set in which similar ratios share a shape bucket; each image is
    cropped at its centre to its snapped ratio (at most 4.3% of one side at 8) and sized by the pipelines' rule for
    it. 0 = the pipelines' own sizes, no crop (always so at micro-batch 1)."""
    bucket_fill: bool = True
    """With micro-batch > 1: complete each shape bucket's remainder with repeats of its own rows, so that every row
    trains in every cycle, also one alone in its shape (a panorama, a scan: repeated within its micro-batch); off
    leaves the remainders out (chosen at random each cycle), and the log names the rows that are then never
    drawn."""
    # NaN and Infinity pass here and are refused by checks._check_sampling with the category's name.
    category_weights: dict[str, Annotated[float, pydantic.AllowInfNan(True)]] = field(default_factory=dict)
    """Relative sampling weight per category (the row's `category` column, or category_rules); {} = no balancing.
    Every category in the data needs a weight ("" = rows without a category; 0 leaves a category out)."""
    category_rules: dict[str, str] = field(default_factory=dict)
    """{category: regular expression}: rows without a `category` value get the first category whose expression
    matches the prompt."""
    normalize_prompts: bool = True
    """Unicode NFC and collapsed whitespace in prompts before encoding."""
    prompt_mapping: str = ""
    """JSON file {"phrase": "replacement"} applied to prompts (whole words, case-insensitive); "" = none."""
    blocked_terms: str = ""
    """Text file, one term per line; prompts containing one are handled by blocked_policy; "" = none."""
    blocked_policy: Literal["drop", "keep"] = "drop"
    """drop: rows whose prompt has a blocked term are left out (counted in the report); keep: only reported."""


@section
class LoraConfig:
    rank: int = 64
    """LoRA rank r."""
    alpha: float = 64.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] | None = None
    """Module names or name suffixes that get LoRA; null = the model family's default, every linear layer of every
    block (Qwen-Image: the attention and MLP projections of both streams, 12 a block; Qwen-Image-2.1: the attention
    projections and the SwiGLU MLP, 7 a block), written out in the resolved config. More targets train more
    parameters and cost more optimizer state."""
    init_from: str = ""
    """Path of a LoRA .safetensors to start from (diffusers, PEFT, DiffSynth-Studio, ComfyUI 'diffusion_model.' or
    kohya 'lora_unet_' keys, read as diffusers' load_lora_weights reads them); its rank must equal lora.rank, and
    lora_B is rescaled when its alpha differs (docs/export.md)."""


@section
class TrainConfig:
    mode: Literal["lora", "full"] = "lora"
    """lora trains adapters on a frozen transformer; full trains every transformer weight."""
    max_steps: int = 1000
    """Optimizer steps to run. CLI: --max_steps."""
    seed: int = 42
    """Seed for LoRA init and data order (same on every rank) and for noise/timesteps (per sample slot). CLI: --seed."""
    timestep_density: Literal["shifted", "uniform", "logit_normal"] = "shifted"
    """How noise levels s are drawn; shifted matches the scheduler's inference shift (train/trainer/objective.py)."""
    shift: float = 0.0
    """Shift for timestep_density=shifted; 0 = the scheduler's dynamic shift for each target size."""
    logit_mean: float = 0.0
    """Mean of the normal for timestep_density=logit_normal."""
    logit_std: float = 1.0
    """Std of the normal for timestep_density=logit_normal."""
    loss_weighting: Literal["none", "cosmap"] = "none"
    """Per-sample loss weight as a function of s: none or cosmap."""
    gradient_checkpointing: bool = False
    """Recompute transformer blocks in backward: far less activation memory, one more forward per step."""
    checkpoint_blocks: int = 0
    """With gradient_checkpointing: how many blocks (the first N) recompute; 0 = all. Each block left out costs
    its activations' memory and saves its recomputation."""
    kept_attention_blocks: int = -1
    """With gradient_checkpointing: how many of the recomputed blocks (the first ones) keep their attention output
    and its log-sum-exp, so that their recomputation skips the attention kernel; -1 = all of them (none for
    Qwen-Image-2.1, whose block-causal attention cannot keep it yet), 0 = none. Each
    costs batch x tokens x heads x (2 x head_dim + 4) bytes of GPU memory (81 MB at 12.5k tokens) and saves about
    half of a block's recomputation (train/model/kept_attention.py, docs/levers.md). The memory plan chooses it
    unless set."""
    compile: bool = False
    """torch.compile each transformer block: a faster step with less activation memory, after a compile of a minute
    or two at the start of a run (and again for each new shape bucket)."""
    attention: Literal["auto", "sdpa", "flex", "segmented"] = "auto"
    """Qwen-Image-2.1's attention processor (its block-causal mask; Qwen-Image models ignore the key): auto =
    segmented where train.compile runs on a CUDA GPU, else sdpa; segmented = this project's mask-free processor
    (train/model/qwen_image21/attention.py: exact, every run as fused-kernel calls in one custom op, rows padded to
    a common prompt length through diffusers' masked calls; the fastest measured on one H200, 7-8% faster steps than
    compiled flex, docs/results/segmented21_h200_2026-12-05.md); flex = diffusers' QwenImage21FlexAttnProcessor
    (one flex_attention call per block; uncompiled it builds a dense float32 score matrix); sdpa = diffusers'
    QwenImage21AttnProcessor (one SDPA call per prompt, reference and target run, text runs with a dense mask)."""
    attention_kernel: Literal["auto", "sdpa", "fa4"] = "auto"
    """The fused attention kernel behind Qwen-Image-2.1's segmented processor and the kept attention of checkpointed
    blocks: sdpa = the one torch's SDPA picks (cuDNN on Hopper); fa4 = FlashAttention-4 (`pip install -e '.[fa4]'`,
    compute capability 9.0 or newer; faster on Hopper, docs/performance.md); auto = fa4 where it is installed and the
    GPU can run it, else sdpa. Other attention calls stay on SDPA."""
    fp8_base: bool = False
    """LoRA only: keep the frozen block weights in float8 e4m3 (half the memory) and run their matmuls in fp8
    (GPUs with compute capability >= 8.9): a faster step; changes the frozen model slightly (train/model/fp8.py),
    so check the validation images."""
    fp8_transposed: bool = False
    """With fp8_base: also keep each frozen weight transposed, as the backward's matmul reads it (twice the fp8
    weight memory, ~13.6 GB more for the full model; saves a pass over the weights per step)."""
    fp8_fast_accum: bool = False
    """With fp8_base: the fp8 matmuls accumulate as Hopper's tensor cores do without cuBLAS's periodic promotion to
    float32 (torch._scaled_mm's use_fast_accum): faster matmuls for an accumulation error about ten times smaller
    than the fp8 weights' own rounding (docs/levers.md). memory.plan "auto" turns it on with the fp8 base it picks
    unless the config sets this key; set false for the exact accumulation."""
    offload_blocks: int = 0
    """LoRA only: the first N blocks keep their frozen weights in pinned host memory, copied to the GPU just ahead
    of use on a side stream (train/model/offload.py); they must be checkpointed (gradient_checkpointing, and
    checkpoint_blocks 0 or >= N). Saves the GPU memory of their weights; costs host memory and PCIe bandwidth."""
    deepcompile: bool = False
    """DeepSpeed's DeepCompile (ZeRO stage 1 or 2, CUDA GPUs): the engine compiles the whole transformer
    (engine.compile()) and DeepSpeed reduces the gradients inside the compiled backward instead of from
    per-parameter hooks. Set here only (it fills DeepSpeed's compile.deepcompile); the frozen base weights become
    buffers, since DeepCompile takes every parameter in its graph for one the optimizer holds, and the trainable
    weights that no output reaches (Qwen-Image's last block's text stream after its attention) are frozen, since it
    needs a gradient for each. Excludes train.compile (per block), offload_blocks, kept attention and DeepSpeed's
    optimizer offload; the memory plan then leaves them out. Off by default: its loss curve matches the default
    path's on one GPU (docs/performance.md), but at full size the plan's per-block compilation, kept attention and
    offload are what fit and speed the step on one GPU; it is for several GPUs, where ZeRO-2's per-parameter hooks
    cost most (docs/multinode.md), once `train.bench --scaling` shows the gain there."""
    max_nonfinite_steps: int = 10
    """Optimizer steps with a NaN/inf loss or gradient norm are skipped with a warning; stop after this many."""
    gc_every_steps: int = 1
    """Python's garbage collector during training: 0 = its automatic collection, as Python runs it (a full collection
    now and then walks every object of the process, ~1 s at full size with the GPU idle); N = automatic collection off
    while training, a young collection every N optimizer steps on every rank at the same step, a full one at a log
    boundary every 100+ steps, and the objects that exist once everything is loaded, and again after the first 3
    steps (compilation, DeepSpeed's state), frozen out of every later walk (train/runtime/collector.py). 1: each
    collection walks only what one step left alive."""


@section
class OutputConfig:
    dir: str = ""
    """Where config, checkpoints, metrics and exports go. CLI: --output_dir."""
    save_every_steps: int = 500
    """DeepSpeed checkpoint cadence in optimizer steps (0 = only at the end)."""
    log_every_steps: int = 10
    """Metrics cadence in optimizer steps (a device sync happens only then)."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones are deleted after each save (0 = keep all)."""
    export_every_steps: int = 0
    """Also export the weights (as the final export, with its metadata) every N optimizer steps into
    OUTPUT/export/step_NNNNNN/ (equal to save_every_steps: one beside every checkpoint); 0 = only the final
    export in OUTPUT/export/."""
    tensorboard: bool = True
    """Write tensorboard scalars under output/tensorboard."""
    gpu_monitor_interval_s: float = 5.0
    """Seconds between samples of per-GPU memory, utilisation, SM clock, power and temperature (nvidia-ml-py) into the
    metrics; 0 = off."""


@section
class ParallelConfig:
    mode: Literal["zero2", "model_parallel"] = "zero2"
    """zero2: data parallel with ZeRO; model_parallel: encoder and decoder stages on separate GPUs, pipelined
    (docs/model_parallel.md)."""
    collective_timeout_s: int = 600
    """Seconds a collective may wait for a dead or stuck rank before every process stops with an error (a rank on
    another node that died is noticed only then)."""
    stages: list[str] = field(default_factory=lambda: ["cuda:0", "cuda:1"])
    """model_parallel: the device of each stage of one pipeline, the encoder's first, then the decoder stage(s);
    one process per stage. Replica j on a node adds j x len(stages) to each index. Without GPUs every stage runs
    on the CPU."""
    decoder_cuts: list[int] = field(default_factory=list)
    """model_parallel: transformer block indices where the decoder is cut over the decoder devices (one fewer than
    them), e.g. [30] with 3 stages runs blocks 0-29 and 30-59 on stages 2 and 3; [] = one decoder stage."""
    queue_depth: int = 2
    """model_parallel: encoded micro-batches that may wait for the decoder (the bounded queue between stages)."""
    overlap: bool = True
    """model_parallel: the encoder encodes ahead while the decoder trains; false = the first decoder stage asks
    for each micro-batch when it needs it, and the encoder encodes only then (the unoverlapped split, for
    measuring the pipeline's gain; training is identical)."""


@section
class InferenceConfig:
    num_inference_steps: int = 40
    """Denoising steps of the edit pipeline (validation images and train.infer)."""
    true_cfg_scale: float = 4.0
    """Classifier-free guidance scale of the pipeline; 1.0 = no guidance (one transformer pass per step)."""
    negative_prompt: str = " "
    """Negative prompt used when true_cfg_scale > 1."""
    area: int = 1024 * 1024
    """Pixel area of generated images and of the references as the pipeline sees them."""
    condition_area: int = 384 * 384
    """Pixel area of the reference copies the VL encoder sees (2509 only), as data.condition_area in training."""
    vae_tiling: bool = False
    """Decode in tiles (less memory at large sizes)."""
    vae_slicing: bool = False
    """Decode a batch one image at a time."""
    cpu_offload: Literal["none", "blocks", "model", "sequential"] = "none"
    """train.infer: blocks (the encoders run first for every row and leave the GPU, then the transformer streams its
    first blocks from pinned host memory, as many as the budget needs), model (whole components in turn) or
    sequential (layer by layer; slowest, least memory). With memory.plan "auto" the budget chooses."""


@section
class ValidationConfig:
    file: str = ""
    """jsonl of validation edits (edit_image, prompt, optional seed), paths relative to its folder; "" = off."""
    every_steps: int = 0
    """Validation cadence in optimizer steps; 0 = only at the end (when file is set)."""


@section
class MemoryConfig:
    plan: Literal["auto", "off"] = "auto"
    """auto: on a GPU, before loading, choose what the config leaves unset among train.fp8_base, fp8_transposed,
    fp8_fast_accum, compile, gradient_checkpointing, checkpoint_blocks, kept_attention_blocks, offload_blocks,
    data.cache and (with
    validation.file, whose renders must fit too) inference.vae_tiling, so that the run fits budget_gb and is as fast
    as it can be there (printed with its predicted peak; docs/memory_plan.md); off: run the keys as written."""
    budget_gb: float = 0.0
    """GPU memory this process may use, in GB; 0 = what the device has free at the start. A lower value caps the
    process there (torch's per-process memory fraction), e.g. to leave room or to simulate a smaller card."""
    margin_gb: float = 0.0
    """Memory the plan keeps free for NCCL, checkpoint saving and fragmentation; 0 = 1.5 GB + 5% of the budget."""


@section
class ProjectConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclasses.dataclass
class Config:
    project: ProjectConfig
    deepspeed: dict
    """DeepSpeed's own keys, resolved for this world size and machine; passed to deepspeed.initialize."""
    world_size: int = 1
    explicit: frozenset[str] = frozenset()
    """Dotted keys under qwen_edit that the JSON or the command line set (the memory plan leaves them alone)."""

    @property
    def micro_batch_size(self) -> int:
        return self.deepspeed["train_micro_batch_size_per_gpu"]

    @property
    def precision(self) -> str:
        if self.deepspeed.get("bf16", {}).get("enabled"):
            return "bfloat16"
        if self.deepspeed.get("fp16", {}).get("enabled"):
            return "float16"
        return "float32"


def field_docs(cls=ProjectConfig, prefix: str = "") -> dict[str, str]:
    """{'model.path': 'docstring', ...}: the descriptions pydantic took from the docstrings under the fields."""
    docs: dict[str, str] = {}
    for name, info in cls.__pydantic_fields__.items():
        if dataclasses.is_dataclass(info.annotation):
            docs.update(field_docs(info.annotation, f"{prefix}{name}."))
        else:
            docs[prefix + name] = info.description
    return docs
