"""Checks of the project section that typing cannot express: ranges, bounds, combinations of keys, and the files
the keys name. Each appends one message per problem, naming the key and the fix; nothing raises.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from train.config import files
from train.config.schema import PROJECT_KEY, ProjectConfig


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
    """Category balancing and the prompt-processing files (train/data/sampling.py, train/data/prompts.py)."""
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
    for key, load in {"prompt_mapping": files.load_mapping, "blocked_terms": files.load_blocked_terms}.items():
        path = getattr(d, key)
        if path and not Path(path).is_file():
            problems.append(f"{p}.{key}: {path!r} is not a file; fix the path or set it to \"\" (none)")
        elif path:
            try:
                load(path)
            except ValueError as e:
                problems.append(f"{p}.{key}: {e}")


def check_project(cfg: ProjectConfig, problems: list[str]) -> None:
    """Every check of the qwen_edit section, in the order its problems are listed."""
    _check_paths(cfg, problems)
    _check_sizes(cfg, problems)
    _check_counts(cfg, problems)
    _check_lora_and_savers(cfg, problems)
    check_offload(cfg, problems)
    _check_timesteps(cfg, problems)
    check_inference(cfg, problems)
    _check_cache(cfg, problems)
    _check_sampling(cfg, problems)


def check_machine(cfg: ProjectConfig, has_gpu: bool, problems: list[str]) -> None:
    """What the machine must have for the settings: train.attention "flex" trains on a CUDA GPU only;
    train.attention_kernel "fa4" needs FlashAttention-4 installed and a GPU that runs it."""
    if cfg.train.attention == "flex" and not has_gpu:
        problems.append(f'{PROJECT_KEY}.train.attention: "flex" needs a CUDA GPU (torch\'s flex_attention has no '
                        'backward on the CPU); set it to "auto" or "sdpa"')
    if cfg.train.attention_kernel == "fa4":
        import torch

        problem = flash_attention_4_problem(torch.device("cuda", 0) if has_gpu else torch.device("cpu"))
        if problem:
            problems.append(f'{PROJECT_KEY}.train.attention_kernel: "fa4": {problem}; or set it to "auto" or "sdpa"')


def flash_attention_4_problem(device) -> str | None:
    """Why FlashAttention-4's kernels (train/model/flash4.py) cannot run on `device`, naming the fix; None where they
    can: a CUDA GPU of compute capability 9.0 or newer with `flash-attn-4` installed."""
    import torch

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "FlashAttention-4 needs a CUDA GPU of compute capability 9.0 or newer"
    try:
        from flash_attn.cute import interface  # noqa: F401
    except ImportError as e:
        return (f"FlashAttention-4 is not installed ({e}): pip install -e '.[fa4]' (setup.cfg's pin, the version "
                "train/model/flash4.py is written against)")
    return None


def _check_paths(cfg: ProjectConfig, problems: list[str]) -> None:
    """The model and data directories exist and hold what they must; the output directory is named."""
    p = PROJECT_KEY
    if not cfg.model.path:
        problems.append(f"{p}.model.path: not set; pass --model DIR (a diffusers-format Qwen-Image-Edit directory)")
    else:
        problems += files.model_dir_problems(cfg.model.path, f"{p}.model.path")
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
    if cfg.data.bucket_aspect_steps < 0:
        problems.append(f"{p}.data.bucket_aspect_steps: must be >= 0 (0 = the pipelines' own sizes, e.g. 8 = "
                        f"aspect ratios 9% apart), got {cfg.data.bucket_aspect_steps}")
    _check_bounds(cfg, problems)
    try:
        files.background_rgb(cfg.data.alpha_background)
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
    non_negative = (("output.keep_last", cfg.output.keep_last, " (0 = keep every checkpoint)"),
                    ("train.max_nonfinite_steps", cfg.train.max_nonfinite_steps,
                     " (0 = stop at the first NaN/inf step)"),
                    ("output.save_every_steps", cfg.output.save_every_steps, " (0 = only at the end)"),
                    ("train.gc_every_steps", cfg.train.gc_every_steps, " (0 = Python's automatic collection)"),
                    ("data.num_workers", cfg.data.num_workers, ""))
    problems += [f"{p}.{key}: must be >= 0{meaning}" for key, value, meaning in non_negative if value < 0]
    if cfg.parallel.collective_timeout_s < 10:
        problems.append(f"{p}.parallel.collective_timeout_s: {cfg.parallel.collective_timeout_s} s is too short for a "
                        "checkpoint save; use at least 10 (default 600)")


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
    if cfg.train.mode == "lora" and cfg.lora.target_modules == []:
        problems.append(f"{p}.lora.target_modules: empty; name at least one module, e.g. \"attn.to_q\", or leave it "
                        "out for the model family's default")
    if cfg.train.checkpoint_blocks < 0:
        problems.append(f"{p}.train.checkpoint_blocks: must be >= 0 (0 = every block), "
                        f"got {cfg.train.checkpoint_blocks}")
    elif cfg.train.checkpoint_blocks and not cfg.train.gradient_checkpointing:
        problems.append(f"{p}.train.checkpoint_blocks: set, but train.gradient_checkpointing is false; enable it or "
                        "set checkpoint_blocks to 0")
    if cfg.train.kept_attention_blocks < -1:
        problems.append(f"{p}.train.kept_attention_blocks: must be >= -1 (-1 = every checkpointed block, 0 = none), "
                        f"got {cfg.train.kept_attention_blocks}")
    if cfg.train.fp8_transposed and not cfg.train.fp8_base:
        problems.append(f"{p}.train.fp8_transposed: only applies with train.fp8_base; enable fp8_base or set "
                        "fp8_transposed to false")
    if cfg.train.fp8_fast_accum and not cfg.train.fp8_base and (cfg.memory.plan == "off" or cfg.train.mode != "lora"):
        problems.append(f"{p}.train.fp8_fast_accum: only applies to an fp8 base (train.fp8_base, LoRA only, set in the "
                        "config or chosen by memory.plan \"auto\"); enable fp8_base or set fp8_fast_accum to false")
    if cfg.train.fp8_base and cfg.train.mode != "lora":
        problems.append(f"{p}.train.fp8_base: needs a frozen base; set train.mode to \"lora\" or fp8_base to false")


def _check_timesteps(cfg: ProjectConfig, problems: list[str]) -> None:
    """The timestep sampling's shift and logit-normal spread."""
    p = PROJECT_KEY
    if cfg.train.shift < 0:
        problems.append(f"{p}.train.shift: must be >= 0 (0 = the scheduler's dynamic shift)")
    if cfg.train.logit_std <= 0:
        problems.append(f"{p}.train.logit_std: must be > 0")


def check_offload(cfg: ProjectConfig, problems: list[str]) -> None:
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


def check_inference(cfg: ProjectConfig, problems: list[str]) -> None:
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
        problems.extend(f"{p}.validation.file: {msg}" for msg in files.validation_file_problems(Path(val.file)))
    if cfg.output.gpu_monitor_interval_s < 0:
        problems.append(f"{p}.output.gpu_monitor_interval_s: must be >= 0 (0 = off)")
