"""Typed configuration: one JSON file holds DeepSpeed's keys plus this project's section `qwen_edit`.

Everything is validated before any model loads, and every problem is reported in one `ConfigError`
that names each key and its fix. A knob lives in one place: precision, micro-batch, gradient
accumulation, clipping, optimizer and LR schedule are DeepSpeed's keys; the rest is ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from train import images, prompts
from train.config import textfile

PROJECT_KEY = "qwen_edit"

# Top-level keys DeepSpeed 0.19 reads (runtime/constants.py and the sub-configs). DeepSpeed ignores
# unknown keys silently, so a typo like "gradient_acumulation_steps" would train with the default.
DEEPSPEED_KEYS = frozenset(
    """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print
    dump_state optimizer scheduler fp16 bf16 bfloat16 amp torch_autocast gradient_clipping
    prescale_gradients gradient_predivide_factor sparse_gradients zero_optimization zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer activation_checkpointing wall_clock_breakdown memory_breakdown flops_profiler
    tensorboard wandb csv_monitor comet comms_logger communication_data_type seq_parallel_communication_data_type
    elasticity checkpoint data_types aio compression_training data_efficiency curriculum_learning
    autotuning nebula pipeline pld disable_allgather dataloader_drop_last timers graph_harvesting
    use_data_before_expert_parallelism_ compile weight_quantization hybrid_engine sparse_attention
    load_universal_checkpoint use_node_local_storage""".split()
)


class ConfigError(ValueError):
    """A user mistake in the configuration; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def choice(*values: str):
    """Field metadata restricting a str field to `values`."""
    return {"choices": values}


@dataclass
class ModelConfig:
    path: str = ""
    """Local diffusers-format directory of Qwen-Image-Edit, -2509, -2511 or Qwen-Image (model_index.json inside).
    CLI: --model."""
    variant: str = field(default="auto", metadata=choice("auto", "edit", "edit_plus", "edit_plus_2511", "t2i"))
    """auto reads model_index.json and transformer/config.json; edit = v1 (one reference), edit_plus = 2509
    (1-3 references), edit_plus_2511 = 2511 (2509 with zero_cond_t), t2i = Qwen-Image / 2512 (no reference); an
    explicit value must match the files."""
    encoder_dtype: str = field(default="auto", metadata=choice("auto", "bfloat16", "float32"))
    """Dtype of the frozen VL encoder and VAE; auto = bfloat16 on GPU, float32 on CPU."""


@dataclass
class DataConfig:
    path: str = ""
    """Directory with metadata.jsonl or metadata.csv and the images it names. CLI: --data."""
    area: int = 1024 * 1024
    """Pixel area targets and VAE copies of references are resized to (aspect kept, sides multiples of 32)."""
    condition_area: int = 384 * 384
    """Pixel area of the copies the VL encoder sees (2509 only; v1 shows it the VAE copy)."""
    alpha_background: str = "white"
    """Colour that transparent pixels (RGBA, LA, palette transparency) are composited over, for training,
    validation and train.infer: a name ("white", "black") or "#rrggbb"."""
    bad_rows: str = field(default="stop", metadata=choice("stop", "skip"))
    """What to do when the pre-flight check finds bad rows: stop with the report, or skip them (reported)."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host memory of batches (ignored on CPU)."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by train.seed and the epoch; off = a fixed order; see train/sampling.py)."""
    cache: str = field(default="off", metadata=choice("off", "auto", "require"))
    """Precomputed latents and prompt embeddings: off encodes online; auto builds the cache when it is missing
    (as python -m train.cache does) and trains from it; require trains from it and stops when it is missing.
    Both refuse a stale cache (built for another model, area, template, data ...) with the reason."""
    cache_dir: str = ""
    """Where the cache lives (on a file system every node sees); "" = OUTPUT/cache."""
    buckets: bool = True
    """Group samples by target and reference shapes so every micro-batch has one shape (micro-batch > 1)."""
    bucket_fill: bool = False
    """With micro-batch > 1: complete each shape bucket's remainder with repeats of its own rows, so that a row
    alone in its shape (a panorama, a scan) is trained too; off leaves remainders out (each cycle other rows), and
    the log names rows that are then never drawn."""
    category_weights: dict[str, float] = field(default_factory=dict)
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
    blocked_policy: str = field(default="drop", metadata=choice("drop", "keep"))
    """drop: rows whose prompt has a blocked term are left out (counted in the report); keep: only reported."""


@dataclass
class LoraConfig:
    rank: int = 64
    """LoRA rank r."""
    alpha: float = 64.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
            "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
        ]
    )
    """Module names or name suffixes that get LoRA (default: attention + MLP projections of every block)."""
    init_from: str = ""
    """Path of a LoRA .safetensors to start from (diffusers, PEFT '.default', ComfyUI 'diffusion_model.' or
    kohya 'lora_unet_' keys)."""


@dataclass
class TrainConfig:
    mode: str = field(default="lora", metadata=choice("lora", "full"))
    """lora trains adapters on a frozen transformer; full trains every transformer weight."""
    max_steps: int = 1000
    """Optimizer steps to run. CLI: --max_steps."""
    seed: int = 42
    """Seed for LoRA init and data order (same on every rank) and for noise/timesteps (per sample slot). CLI: --seed."""
    timestep_density: str = field(default="shifted", metadata=choice("shifted", "uniform", "logit_normal"))
    """How noise levels s are drawn; shifted matches the scheduler's inference shift (see objective.py)."""
    shift: float = 0.0
    """Shift for timestep_density=shifted; 0 = the scheduler's dynamic shift for each target size."""
    logit_mean: float = 0.0
    """Mean of the normal for timestep_density=logit_normal."""
    logit_std: float = 1.0
    """Std of the normal for timestep_density=logit_normal."""
    loss_weighting: str = field(default="none", metadata=choice("none", "cosmap"))
    """Per-sample loss weight as a function of s."""
    gradient_checkpointing: bool = False
    """Recompute transformer blocks in backward: far less activation memory, one more forward per step."""
    checkpoint_blocks: int = 0
    """With gradient_checkpointing: how many blocks (the first N) recompute; 0 = all. Each block left out costs
    its activations' memory and saves its recomputation (docs/performance.md)."""
    compile: bool = False
    """torch.compile each transformer block: the first steps compile; then faster (docs/performance.md)."""
    fp8_base: bool = False
    """LoRA only: keep the frozen block weights in float8 e4m3 (half the memory) and run their matmuls in fp8
    (GPUs with compute capability >= 8.9); changes the frozen model slightly (train/fp8.py)."""
    fp8_transposed: bool = False
    """With fp8_base: also keep each frozen weight transposed, as the backward's matmul reads it (twice the fp8
    weight memory, ~13.6 GB more for the full model; saves a pass over the weights per step)."""
    offload_blocks: int = 0
    """LoRA only: the first N blocks keep their frozen weights in pinned host memory, copied to the GPU just ahead
    of use on a side stream (train/offload.py); they must be checkpointed (gradient_checkpointing, and
    checkpoint_blocks 0 or >= N). Saves the GPU memory of their weights; costs host memory and PCIe bandwidth."""
    max_nonfinite_steps: int = 10
    """Optimizer steps with a NaN/inf loss or gradient norm are skipped with a warning; stop after this many."""


@dataclass
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
    OUTPUT/export/step_NNNNNN/; 0 = only the final export in OUTPUT/export/."""
    tensorboard: bool = True
    """Write tensorboard scalars under output/tensorboard."""
    gpu_monitor_interval_s: float = 5.0
    """Seconds between samples of per-GPU memory and utilisation (nvidia-ml-py) into the metrics; 0 = off."""


@dataclass
class ParallelConfig:
    mode: str = field(default="zero2", metadata=choice("zero2", "model_parallel"))
    """zero2: data parallel with ZeRO; model_parallel: encoder and decoder stages on separate GPUs, pipelined
    (docs/model_parallel.md)."""
    collective_timeout_s: int = 600
    """Seconds a collective may wait for a dead or stuck rank before every process stops with an error."""
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


@dataclass
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
    cpu_offload: str = field(default="none", metadata=choice("none", "model", "sequential"))
    """Move idle components to the CPU: model (whole components) or sequential (layers; slowest, least memory)."""


@dataclass
class ValidationConfig:
    file: str = ""
    """jsonl of validation edits (edit_image, prompt, optional seed), paths relative to its folder; "" = off."""
    every_steps: int = 0
    """Validation cadence in optimizer steps; 0 = only at the end (when file is set)."""


@dataclass
class MemoryConfig:
    plan: str = field(default="auto", metadata=choice("auto", "off"))
    """auto: on a GPU, before loading, choose what the config leaves unset among train.fp8_base, fp8_transposed,
    compile, gradient_checkpointing, checkpoint_blocks, offload_blocks and data.cache, so that the run fits
    budget_gb and is as fast as it can be there (printed with its predicted peak); off: run the keys as written."""
    budget_gb: float = 0.0
    """GPU memory this process may use, in GB; 0 = what the device has free at the start. A lower value caps the
    process there (torch's per-process memory fraction), e.g. to leave room or to simulate a smaller card."""
    margin_gb: float = 0.0
    """Memory the plan keeps free for NCCL, checkpoint saving and fragmentation; 0 = 1.5 GB + 5% of the budget."""


@dataclass
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


@dataclass
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


def _type_ok(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _build(cls, data, path: str, problems: list[str]):
    """Instantiate dataclass `cls` from `data`, appending a message per problem instead of raising."""
    if not isinstance(data, dict):
        problems.append(f"{path}: expected an object, got {type(data).__name__}; write it as {{...}}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            near = [n for n in fields if n[:4] == key[:4]]
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{path}.{key}: unknown key{hint}; known keys: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in data:
            continue
        hint, value = hints[name], data[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{path}.{name}", problems)
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{path}.{name}: {value} is not a finite number; write a finite value")
        elif not _type_ok(value, hint):
            want = getattr(hint, "__name__", str(hint))
            problems.append(f"{path}.{name}: expected {want}, got {json.dumps(value)}; fix its type in the JSON")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"{path}.{name}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
        else:
            values[name] = value
    return cls(**values)


def _check_cache(cfg: ProjectConfig, problems: list[str]) -> None:
    """The latent/embedding cache settings (whether a cache is present and fresh is checked by train.cache)."""
    if not (cfg.data.cache_dir or cfg.output.dir):
        return  # output.dir's own problem is reported
    where = Path(cfg.data.cache_dir or Path(cfg.output.dir) / "cache")
    if where.exists() and not where.is_dir():
        key = "data.cache_dir" if cfg.data.cache_dir else "output.dir"
        problems.append(f"{PROJECT_KEY}.{key}: the cache directory {str(where)!r} is a file; point "
                        f"{PROJECT_KEY}.data.cache_dir at a directory (\"\" = OUTPUT/cache)")


def _check_sampling(cfg: ProjectConfig, problems: list[str]) -> None:
    """Category balancing and the prompt-processing files (train/sampling.py, train/prompts.py)."""
    d, p = cfg.data, f"{PROJECT_KEY}.data"
    for name, weight in d.category_weights.items():
        if not (math.isfinite(weight) and weight >= 0):
            problems.append(f"{p}.category_weights[{name!r}]: must be a number >= 0 (0 leaves the category out), "
                            f"got {weight}")
    if d.category_weights and not any(w > 0 for w in d.category_weights.values()):
        problems.append(f"{p}.category_weights: every weight is 0; give at least one category a weight > 0, "
                        "or set it to {} for no balancing")
    for name, expr in d.category_rules.items():
        try:
            re.compile(expr)
        except re.error as e:
            problems.append(f"{p}.category_rules[{name!r}]: {expr!r} is not a regular expression ({e}); "
                            "fix it (Python re syntax)")
    for key, load in {"prompt_mapping": prompts.load_mapping, "blocked_terms": prompts.load_blocked_terms}.items():
        path = getattr(d, key)
        if path and not Path(path).is_file():
            problems.append(f"{p}.{key}: {path!r} is not a file; fix the path or set it to \"\" (none)")
        elif path:
            try:
                load(path)
            except ValueError as e:
                problems.append(f"{p}.{key}: {e}")


def _check_project(cfg: ProjectConfig, problems: list[str]) -> None:
    """Every check of the qwen_edit section, in the order its problems are listed."""
    _check_paths(cfg, problems)
    _check_sizes(cfg, problems)
    _check_counts(cfg, problems)
    _check_lora_and_savers(cfg, problems)
    _check_offload(cfg, problems)
    _check_timesteps(cfg, problems)
    _check_inference(cfg, problems)
    _check_cache(cfg, problems)
    _check_sampling(cfg, problems)


def _check_paths(cfg: ProjectConfig, problems: list[str]) -> None:
    """The model and data directories exist and hold what they must; the output directory is named."""
    p = PROJECT_KEY
    if not cfg.model.path:
        problems.append(f"{p}.model.path: not set; pass --model DIR (a diffusers-format Qwen-Image-Edit directory)")
    elif not (Path(cfg.model.path) / "model_index.json").is_file():
        problems.append(f"{p}.model.path: {cfg.model.path!r} has no model_index.json; point --model at the "
                        "directory that holds model_index.json, transformer/, vae/, text_encoder/ ...")
    if not cfg.data.path:
        problems.append(f"{p}.data.path: not set; pass --data DIR (a folder with metadata.jsonl or metadata.csv)")
    elif not any((Path(cfg.data.path) / n).is_file() for n in ("metadata.jsonl", "metadata.csv")):
        problems.append(f"{p}.data.path: {cfg.data.path!r} has no metadata.jsonl or metadata.csv")
    if not cfg.output.dir:
        problems.append(f"{p}.output.dir: not set; pass --output_dir DIR")


def _check_sizes(cfg: ProjectConfig, problems: list[str]) -> None:
    """Areas, ranks and step counts: positive, at least one tile, below the upper bounds; the background colour."""
    p = PROJECT_KEY
    positive = {"data.area": cfg.data.area, "data.condition_area": cfg.data.condition_area,
                "lora.rank": cfg.lora.rank, "train.max_steps": cfg.train.max_steps,
                "output.log_every_steps": cfg.output.log_every_steps, "lora.alpha": cfg.lora.alpha}
    for key, value in positive.items():
        if value <= 0:
            problems.append(f"{p}.{key}: must be > 0, got {value}")
    for key, value in {"data.area": cfg.data.area, "data.condition_area": cfg.data.condition_area}.items():
        if 0 < value < 32 * 32:
            problems.append(f"{p}.{key}: {value} px is below one 32x32 tile; use at least 1024 (e.g. 128*128=16384)")
    _check_bounds(cfg, problems)
    try:
        images.background_rgb(cfg.data.alpha_background)
    except ValueError as e:
        problems.append(str(e))


def _check_counts(cfg: ProjectConfig, problems: list[str]) -> None:
    """Cadences, counts and timeouts that must be >= 0 (or long enough), and the export cadence's mode."""
    p = PROJECT_KEY
    if cfg.output.export_every_steps < 0:
        problems.append(f"{p}.output.export_every_steps: must be >= 0 (0 = only the final export)")
    elif cfg.output.export_every_steps and cfg.parallel.mode == "model_parallel":
        problems.append(f"{p}.output.export_every_steps: not available in the model_parallel mode; set it to 0 and "
                        "export checkpoints with python -m train.export --checkpoint OUTPUT/global_stepN --out DIR")
    if cfg.output.keep_last < 0:
        problems.append(f"{p}.output.keep_last: must be >= 0 (0 = keep every checkpoint)")
    if cfg.train.max_nonfinite_steps < 0:
        problems.append(f"{p}.train.max_nonfinite_steps: must be >= 0 (0 = stop at the first NaN/inf step)")
    if cfg.parallel.collective_timeout_s < 10:
        problems.append(f"{p}.parallel.collective_timeout_s: {cfg.parallel.collective_timeout_s} s is too short for a "
                        "checkpoint save; use at least 10 (default 600)")
    if cfg.output.save_every_steps < 0:
        problems.append(f"{p}.output.save_every_steps: must be >= 0 (0 = only at the end)")
    if cfg.data.num_workers < 0:
        problems.append(f"{p}.data.num_workers: must be >= 0")


def _check_lora_and_savers(cfg: ProjectConfig, problems: list[str]) -> None:
    """The LoRA settings and the memory savers (gradient checkpointing, fp8) against train.mode."""
    p = PROJECT_KEY
    if not 0 <= cfg.lora.dropout < 1:
        problems.append(f"{p}.lora.dropout: must be in [0, 1), got {cfg.lora.dropout}")
    if cfg.lora.init_from and not Path(cfg.lora.init_from).is_file():
        problems.append(f"{p}.lora.init_from: {cfg.lora.init_from!r} is not a file; point it at a LoRA .safetensors "
                        "or set it to \"\" to start from a fresh LoRA")
    elif cfg.lora.init_from and cfg.train.mode != "lora":
        problems.append(f"{p}.lora.init_from: set, but train.mode is {cfg.train.mode!r}; it starts a LoRA run only. "
                        "Set train.mode to \"lora\" or init_from to \"\"")
    if cfg.train.mode == "lora" and not cfg.lora.target_modules:
        problems.append(f"{p}.lora.target_modules: empty; name at least one module, e.g. \"attn.to_q\"")
    if cfg.train.checkpoint_blocks < 0:
        problems.append(f"{p}.train.checkpoint_blocks: must be >= 0 (0 = every block), "
                        f"got {cfg.train.checkpoint_blocks}")
    elif cfg.train.checkpoint_blocks and not cfg.train.gradient_checkpointing:
        problems.append(f"{p}.train.checkpoint_blocks: set, but train.gradient_checkpointing is false; enable it or "
                        "set checkpoint_blocks to 0")
    if cfg.train.fp8_transposed and not cfg.train.fp8_base:
        problems.append(f"{p}.train.fp8_transposed: only applies with train.fp8_base; enable fp8_base or set "
                        "fp8_transposed to false")
    if cfg.train.fp8_base and cfg.train.mode != "lora":
        problems.append(f"{p}.train.fp8_base: needs a frozen base; set train.mode to \"lora\" or fp8_base to false")


def _check_timesteps(cfg: ProjectConfig, problems: list[str]) -> None:
    """The timestep sampling's shift and logit-normal spread."""
    p = PROJECT_KEY
    if cfg.train.shift < 0:
        problems.append(f"{p}.train.shift: must be >= 0 (0 = the scheduler's dynamic shift)")
    if cfg.train.logit_std <= 0:
        problems.append(f"{p}.train.logit_std: must be > 0")


def _check_offload(cfg: ProjectConfig, problems: list[str]) -> None:
    """Block offloading and the memory plan's numbers."""
    p, t, m = PROJECT_KEY, cfg.train, cfg.memory
    for key, value in {"budget_gb": m.budget_gb, "margin_gb": m.margin_gb}.items():
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{p}.memory.{key}: must be a number >= 0 (0 = automatic), got {value}")
    if t.offload_blocks < 0:
        problems.append(f"{p}.train.offload_blocks: must be >= 0 (0 = every block on the GPU), got {t.offload_blocks}")
    elif t.offload_blocks:
        if t.mode != "lora":
            problems.append(f"{p}.train.offload_blocks: needs a frozen base (train.mode \"lora\"); full fine-tuning "
                            "offloads with DeepSpeed's zero_optimization.offload_optimizer instead")
        if not t.gradient_checkpointing or 0 < t.checkpoint_blocks < t.offload_blocks:
            problems.append(f"{p}.train.offload_blocks: {t.offload_blocks} offloaded blocks must be checkpointed; set "
                            "train.gradient_checkpointing true and checkpoint_blocks 0 (all) or >= offload_blocks")
        if cfg.parallel.mode != "zero2":
            problems.append(f"{p}.train.offload_blocks: not in the model-parallel mode (its decoder cut spreads the "
                            "blocks over GPUs instead); set it to 0")


MAX_AREA = 8192 * 8192
MAX_SEED = 2**32 - 1


def _check_bounds(cfg: ProjectConfig, problems: list[str]) -> None:
    """Upper bounds: sizes that no run can use fail here, not hours later (or never, as a worker count that
    exhausts the machine's processes)."""
    p = PROJECT_KEY
    bounds = {"data.area": (cfg.data.area, MAX_AREA, "8192x8192 px; Qwen-Image works at about 1024*1024"),
              "data.condition_area": (cfg.data.condition_area, MAX_AREA, "8192x8192 px; the default is 384*384"),
              "train.seed": (cfg.train.seed, MAX_SEED, "2^32 - 1"),
              "data.num_workers": (cfg.data.num_workers, 64, "64 DataLoader workers per rank"),
              "lora.rank": (cfg.lora.rank, 3072, "3072, the transformer's width"),
              "parallel.collective_timeout_s": (cfg.parallel.collective_timeout_s, 7 * 86400, "a week"),
              "parallel.queue_depth": (cfg.parallel.queue_depth, 64, "64 micro-batches"),
              "output.gpu_monitor_interval_s": (cfg.output.gpu_monitor_interval_s, 3600, "an hour")}
    for key, (value, limit, what) in bounds.items():
        if value > limit:
            problems.append(f"{p}.{key}: {value} is above {limit} ({what}); use a smaller value")
    if cfg.train.seed < 0:
        problems.append(f"{p}.train.seed: must be >= 0, got {cfg.train.seed}")


def _check_inference(cfg: ProjectConfig, problems: list[str]) -> None:
    """The inference section (validation images and train.infer), the validation file, the GPU monitor."""
    p, inf, val = PROJECT_KEY, cfg.inference, cfg.validation
    if inf.num_inference_steps <= 0:
        problems.append(f"{p}.inference.num_inference_steps: must be > 0, got {inf.num_inference_steps}")
    if inf.true_cfg_scale < 1:
        problems.append(f"{p}.inference.true_cfg_scale: must be >= 1 (1.0 = no guidance), got {inf.true_cfg_scale}")
    for key, value in {"inference.area": inf.area, "inference.condition_area": inf.condition_area}.items():
        if value < 32 * 32:
            problems.append(f"{p}.{key}: {value} px is below one 32x32 tile; use at least 1024 (e.g. 128*128=16384)")
        elif value > MAX_AREA:
            problems.append(f"{p}.{key}: {value} px is above {MAX_AREA} (8192x8192); use about 1024*1024")
    if inf.num_inference_steps > 1000:
        problems.append(f"{p}.inference.num_inference_steps: {inf.num_inference_steps} is above 1000; use 20-50")
    if val.every_steps < 0:
        problems.append(f"{p}.validation.every_steps: must be >= 0 (0 = only at the end)")
    elif val.every_steps and not val.file:
        problems.append(f"{p}.validation.every_steps: {val.every_steps}, but validation.file is \"\"; set "
                        "validation.file to a jsonl of edits, or every_steps to 0")
    if val.file:
        problems.extend(f"{p}.validation.file: {msg}" for msg in _validation_file_problems(Path(val.file)))
    if cfg.output.gpu_monitor_interval_s < 0:
        problems.append(f"{p}.output.gpu_monitor_interval_s: must be >= 0 (0 = off)")


def _validation_file_problems(path: Path, limit: int = 5) -> list[str]:
    """Problems of a validation jsonl: it must exist, every row parse, and every image it names exist."""
    if not path.is_file():
        return [f"{str(path)!r} does not exist; point it at a jsonl of {{\"edit_image\": ..., \"prompt\": ...}} rows"]
    problems, rows = [], 0
    try:
        numbered = textfile.lines(path)
    except textfile.TextFileError as e:
        return [str(e)]
    for n, text in numbered:
        if not text.strip():
            continue
        rows += 1
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(f"{path} line {n}: not valid JSON ({e.msg})")
            continue
        refs = row.get("edit_image", []) if isinstance(row, dict) else None  # none: a text-to-image row
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
            problems.append(f"{path} line {n}: needs 'prompt' and, for an edit, 'edit_image' (a path or a list of "
                            "paths)")
        elif not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            problems.append(f"{path} line {n}: empty or missing 'prompt'")
        else:
            problems.extend(f"{path} line {n}: image {r!r} not found (paths are relative to the file's folder)"
                            for r in refs if not (path.parent / r).is_file())
    if not rows:
        problems.append(f"{path} has no rows")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


def _explicit(raw: dict) -> set[str]:
    """Dotted keys (section.name) that a config's qwen_edit section sets."""
    project = raw.get(PROJECT_KEY, {}) if isinstance(raw, dict) else {}
    return {f"{section}.{key}" for section, body in project.items() if isinstance(body, dict) for key in body}


def explicit_keys(path: str | os.PathLike | None) -> set[str]:
    """_explicit of the JSON file at `path` (a file inference_settings has read already); none without one."""
    return set() if path is None else _explicit(json.loads(textfile.read_text(Path(path))))


def inference_settings(path: str | os.PathLike | None) -> ProjectConfig:
    """The project section of a JSON config for train.infer (defaults without a file); only the inference
    section and the GPU monitor interval are checked. Raises ConfigError."""
    if path is None:
        return ProjectConfig()
    path = Path(path)
    try:
        raw = json.loads(textfile.read_text(path))
    except (OSError, json.JSONDecodeError, textfile.TextFileError) as e:
        raise ConfigError([f"--config: cannot read {path} as JSON ({e})"]) from e
    problems: list[str] = []
    project = _build(ProjectConfig, raw.get(PROJECT_KEY, {}) if isinstance(raw, dict) else raw, PROJECT_KEY, problems)
    project.validation = ValidationConfig()  # a training config's validation file is no concern of train.infer
    _check_inference(project, problems)
    _check_offload(project, problems)  # its memory section (budget_gb, margin_gb)
    if problems:
        raise ConfigError(problems)
    return project


def _check_parallel(cfg: ProjectConfig, problems: list[str], world_size: int, num_gpus: int | None = None,
                    fp16: bool = False) -> None:
    """The model-parallel placement: device names, cuts, world size; devices against `num_gpus` when known."""
    if cfg.parallel.mode != "model_parallel":
        return
    from model_parallel.plan import PlanError, build_plan

    key = f"{PROJECT_KEY}.parallel"
    if cfg.parallel.queue_depth < 1:
        problems.append(f"{key}.queue_depth: must be >= 1, got {cfg.parallel.queue_depth}")
    if fp16 and cfg.parallel.decoder_cuts:
        problems.append(f"{key}.decoder_cuts: fp16's loss scaling is not carried across a cut; use bf16")
    if cfg.validation.file and cfg.parallel.decoder_cuts:
        problems.append(f"{PROJECT_KEY}.validation.file: validation images need the whole transformer on one decoder "
                        f"stage, but {key}.decoder_cuts {cfg.parallel.decoder_cuts} cuts it; set validation.file to "
                        "\"\" (and render the export with python -m train.infer) or decoder_cuts to []")
    num_blocks = 10**9  # unknown until the model is readable; then the transformer's block count
    config_file = Path(cfg.model.path) / "transformer" / "config.json"
    if cfg.model.path and config_file.is_file():
        num_blocks = json.loads(config_file.read_text()).get("num_layers", 60)
    try:
        build_plan(cfg.parallel.stages, cfg.parallel.decoder_cuts, world_size, num_blocks, num_gpus or 0)
    except PlanError as e:
        problems.append(str(e))


def _section(parent: dict, key: str, name: str, problems: list[str]) -> dict:
    """parent[key] when it is an object (or absent: {}); otherwise a problem naming `name`, and {}."""
    value = parent.get(key, {})
    if isinstance(value, dict):
        return value
    problems.append(f"{name}: expected an object, got {json.dumps(value)}; write it as {{...}}")
    return {}


def _check_deepspeed(ds: dict, world_size: int, max_steps: int, problems: list[str]) -> None:
    for key in ds:
        if key not in DEEPSPEED_KEYS and key != PROJECT_KEY:
            problems.append(f"{key}: unknown top-level key (neither DeepSpeed's nor {PROJECT_KEY!r}); "
                            f"remove it or move it into the {PROJECT_KEY!r} section")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key}: must be an integer >= 1, got {json.dumps(value)}")
    micro, gas = ds.get("train_micro_batch_size_per_gpu", 1), ds.get("gradient_accumulation_steps", 1)
    total = ds.get("train_batch_size")
    if total is not None and isinstance(micro, int) and isinstance(gas, int) and total != micro * gas * world_size:
        problems.append(
            f"train_batch_size: {total} != train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps "
            f"({gas}) x world size ({world_size}) = {micro * gas * world_size}; remove train_batch_size so one file "
            "fits any world size"
        )
    bf16, fp16 = (_section(ds, k, k, problems) for k in ("bf16", "fp16"))
    if bf16.get("enabled") and fp16.get("enabled"):
        problems.append("bf16.enabled and fp16.enabled: both true; enable one (bf16 for Qwen-Image)")
    stage = _section(ds, "zero_optimization", "zero_optimization", problems).get("stage", 0)
    if stage not in (0, 1, 2):
        problems.append(f"zero_optimization.stage: {stage} is not supported in the zero2 mode; use 0, 1 or 2")
    _section(_section(ds, "optimizer", "optimizer", problems), "params", "optimizer.params", problems)
    params = _section(_section(ds, "scheduler", "scheduler", problems), "params", "scheduler.params", problems)
    if "total_num_steps" in params and params["total_num_steps"] != max_steps:
        problems.append(f"scheduler.params.total_num_steps: {params['total_num_steps']} != "
                        f"{PROJECT_KEY}.train.max_steps ({max_steps}); remove total_num_steps (filled from max_steps)")


def _nonfinite(value, path: str) -> list[str]:
    """Dotted paths of the NaN/Infinity numbers inside `value` (Python's json reads them; they are no JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nonfinite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nonfinite(v, f"{path}[{i}]")]
    return []


def _non_bool_switches(value, path: str = "") -> list[str]:
    """'bf16.enabled: "false"'-style problems: an `enabled` key that is not true/false (DeepSpeed's pydantic models
    turn the string "false" into False, while any non-empty string is true to Python: the two would disagree)."""
    if not isinstance(value, dict):
        return []
    found = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key == "enabled" and not isinstance(item, bool):
            found.append(f"{where}: expected true or false, got {json.dumps(item)}; write it without quotes")
        found += _non_bool_switches(item, where)
    return found


def _check_deepspeed_values(ds: dict, problems: list[str]) -> None:
    """DeepSpeed's own keys that DeepSpeed checks only when the engine starts (after the models have loaded): the
    optimizer and scheduler names it accepts, the learning rate, clipping, NaN/Infinity, true/false switches."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    nonfinite = _nonfinite(ds, "")
    problems += [f"{p}: not a finite number; write a finite value" for p in nonfinite]
    problems += _non_bool_switches(ds)
    optimizer, scheduler = ds.get("optimizer"), ds.get("scheduler")
    if isinstance(optimizer, dict):
        name = optimizer.get("type")
        if not isinstance(name, str) or not (name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name)):
            problems.append(f"optimizer.type: {json.dumps(name)} is neither a DeepSpeed optimizer "
                            f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class; e.g. \"AdamW\"")
        lr = optimizer.get("params", {}).get("lr") if isinstance(optimizer.get("params"), dict) else None
        if lr is not None and "optimizer.params.lr" not in nonfinite and not (
                isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0):
            problems.append(f"optimizer.params.lr: must be a number >= 0, got {json.dumps(lr)}")
    if isinstance(scheduler, dict):
        name = scheduler.get("type")
        if not isinstance(name, str) or not (name in VALID_LR_SCHEDULES or hasattr(torch.optim.lr_scheduler, name)):
            problems.append(f"scheduler.type: {json.dumps(name)} is neither a DeepSpeed schedule "
                            f"({', '.join(VALID_LR_SCHEDULES)}) nor a torch.optim.lr_scheduler class")
    clip = ds.get("gradient_clipping", 0)
    if "gradient_clipping" not in nonfinite and not (isinstance(clip, (int, float)) and not isinstance(clip, bool)
                                                     and clip >= 0):
        problems.append(f"gradient_clipping: must be a number >= 0 (0 = off), got {json.dumps(clip)}")


# DeepSpeed's pydantic models by the top-level key they read, for naming the key of a validation error.
_DS_MODEL_KEYS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
                  "DeepSpeedFP16Config": "fp16", "HybridEngineConfig": "hybrid_engine"}


def _check_with_deepspeed(ds: dict, problems: list[str]) -> None:
    """Let DeepSpeed's own config classes (DeepSpeedConfig and its pydantic models, extra="forbid") read the
    resolved section now, before any model loads, instead of in deepspeed.initialize. train_batch_size is left
    out: it is checked against the world size above, and DeepSpeedConfig here sees a world of one."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig({k: v for k, v in ds.items() if k != "train_batch_size"})
    except pydantic.ValidationError as e:
        section = _DS_MODEL_KEYS.get(e.title, f"DeepSpeed's {e.title}")
        for err in e.errors():
            where = ".".join(str(part) for part in (section, *err["loc"]))
            problems.append(f"{where}: {err['msg']} (DeepSpeed's check); fix or remove the key")
    except (ValueError, AssertionError, KeyError, TypeError) as e:
        problems.append(f"DeepSpeed refuses the configuration: {e}")


def resolve_deepspeed(ds: dict, max_steps: int, has_gpu: bool) -> dict:
    """DeepSpeed's section as it will be run: project section removed, schedule length and CPU choices filled."""
    ds = json.loads(json.dumps({k: v for k, v in ds.items() if k != PROJECT_KEY}))
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.setdefault("steps_per_print", 10**9)  # progress goes through our own logger
    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
        scheduler.setdefault("params", {})["total_num_steps"] = max_steps
    if not has_gpu:
        if ds.get("fp16", {}).get("enabled"):
            ds["fp16"]["enabled"] = False  # CPUs have no fast fp16 training path; bf16 is the nearest
            ds.setdefault("bf16", {})["enabled"] = True
        optimizer = ds.get("optimizer")
        if optimizer and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
            # DeepSpeed's fused Adam is CUDA only; torch's Adam also skips a 40 s CPU op build.
            optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return ds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune Qwen-Image-Edit / -2509 with DeepSpeed")
    parser.add_argument("--ds_config", required=True, help="JSON: DeepSpeed keys + the qwen_edit section")
    parser.add_argument("--model", help=f"overrides {PROJECT_KEY}.model.path")
    parser.add_argument("--data", help=f"overrides {PROJECT_KEY}.data.path")
    parser.add_argument("--output_dir", help=f"overrides {PROJECT_KEY}.output.dir")
    parser.add_argument("--max_steps", type=int, help=f"overrides {PROJECT_KEY}.train.max_steps")
    parser.add_argument("--seed", type=int, help=f"overrides {PROJECT_KEY}.train.seed")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                        help="resume from OUTPUT/latest, or from OUTPUT/TAG (e.g. global_step500)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start anew in an output directory that holds another run: its checkpoints, metrics "
                             "and exports are deleted once every check has passed")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.overwrite and args.resume is not None:
        parser.error("--overwrite deletes the run that --resume continues; pass one of them")
    return args


def load_config(args: argparse.Namespace, world_size: int, has_gpu: bool, num_gpus: int | None = None) -> Config:
    """Read, override, validate and resolve; raises ConfigError listing every problem. `num_gpus` (GPUs of this
    node, None = unknown) checks the model-parallel devices."""
    path = Path(args.ds_config)
    if not path.is_file():
        raise ConfigError([f"--ds_config: {str(path)!r} does not exist; pass a file such as ds_configs/zero2.json"])
    try:
        raw = json.loads(textfile.read_text(path))
    except textfile.TextFileError as e:
        raise ConfigError([f"--ds_config: {e}"]) from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}: {e.msg}"
        raise ConfigError([f"--ds_config: {path} is not valid JSON ({where})"]) from e
    if not isinstance(raw, dict):
        raise ConfigError([f"--ds_config: {path} must hold a JSON object at the top level"])
    problems: list[str] = []
    project = _build(ProjectConfig, raw.get(PROJECT_KEY, {}), PROJECT_KEY, problems)
    overrides = {"model.path": args.model, "data.path": args.data, "output.dir": args.output_dir,
                 "train.max_steps": args.max_steps, "train.seed": args.seed}
    for dotted, value in overrides.items():
        if value is not None:
            section, name = dotted.split(".")
            setattr(getattr(project, section), name, value)
    _check_project(project, problems)
    _check_parallel(project, problems, world_size, num_gpus if has_gpu else 0,
                    fp16=bool(isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled")))
    _check_deepspeed(raw, world_size, project.train.max_steps, problems)
    _check_deepspeed_values({k: v for k, v in raw.items() if k != PROJECT_KEY}, problems)
    if problems:
        raise ConfigError(problems)
    resolved = resolve_deepspeed(raw, project.train.max_steps, has_gpu)
    _check_with_deepspeed(resolved, problems)  # only a config that passed the checks above
    if problems:
        raise ConfigError(problems)
    explicit = _explicit(raw) | {dotted for dotted, value in overrides.items() if value is not None}
    return Config(project=project, deepspeed=resolved, world_size=world_size, explicit=frozenset(explicit))


def to_dict(config: Config) -> dict:
    """The resolved config as one JSON-able dict in the input layout (DeepSpeed keys + project section)."""
    return {**config.deepspeed, PROJECT_KEY: dataclasses.asdict(config.project)}


def write_resolved(config: Config, directory: str | os.PathLike) -> Path:
    out = Path(directory) / "config.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_dict(config), indent=2) + "\n")
    tmp.replace(out)
    return out


def field_docs(cls=ProjectConfig, prefix: str = "") -> dict[str, str]:
    """{'model.path': 'docstring', ...} read from the attribute docstrings in this file (for docs and tests)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[prefix + node.target.id] = nxt.value.value
    for name, hint in hints.items():
        if dataclasses.is_dataclass(hint) and not isinstance(hint, types.GenericAlias):
            docs.update(field_docs(hint, f"{prefix}{name}."))
    return docs
