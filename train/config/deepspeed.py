"""DeepSpeed's own keys: the names DeepSpeed reads, the checks it would make only once the engine starts (run
here before any model loads, with DeepSpeed's own config classes where it has them), and the section as it will run.
"""

from __future__ import annotations

import difflib
import json
import math
import typing

import pydantic

from train.config.schema import PROJECT_KEY, ProjectConfig

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


def _section(parent: dict, key: str, name: str, problems: list[str]) -> dict:
    """parent[key] when it is an object (or absent: {}); otherwise a problem naming `name`, and {}."""
    value = parent.get(key, {})
    if isinstance(value, dict):
        return value
    problems.append(f"{name}: expected an object, got {json.dumps(value)}; write it as {{...}}")
    return {}


def check_deepspeed(ds: dict, world_size: int, max_steps: int, problems: list[str]) -> None:
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


def check_deepspeed_values(ds: dict, problems: list[str]) -> None:
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


def reported_keys(problems: list[str]) -> set[str]:
    """The top-level keys that `problems` name (each problem starts with its dotted key)."""
    return {p.split(":", 1)[0].split(".", 1)[0].split("[", 1)[0].split(" ", 1)[0] for p in problems}


def check_with_deepspeed(ds: dict, problems: list[str]) -> None:
    """Let DeepSpeed's own config classes (DeepSpeedConfig and its pydantic models, extra="forbid") read the
    resolved section now, before any model loads, instead of in deepspeed.initialize. train_batch_size is left
    out: it is checked against the world size above, and DeepSpeedConfig here sees a world of one. DeepSpeed stops
    at the first section it refuses: that section is set aside and the rest read again, so that every section's
    problems are listed together."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = {k: v for k, v in ds.items() if k != "train_batch_size"}
    for _ in range(len(_DS_MODEL_KEYS) + 1):
        try:
            DeepSpeedConfig(ds)
            return
        except pydantic.ValidationError as e:
            section = _DS_MODEL_KEYS.get(e.title)
            for err in e.errors():
                where = ".".join(str(part) for part in (section or f"DeepSpeed's {e.title}", *err["loc"]))
                near = _near_key(e.title, err)
                fix = f"rename it to {near!r} or remove it" if near else "fix or remove the key"
                problems.append(f"{where}: {err['msg']} (DeepSpeed's check); {fix}")
            if section not in ds:
                return
            ds = {k: v for k, v in ds.items() if k != section}
        except (ValueError, AssertionError, KeyError, TypeError) as e:
            problems.append(f"DeepSpeed refuses the configuration: {e}")
            return


def _near_key(model_name: str, err: dict) -> str | None:
    """The known key of DeepSpeed's model `model_name` closest to the unknown key of `err`, or None."""
    if err["type"] != "extra_forbidden":
        return None
    model = _ds_model(model_name)
    for part in err["loc"][:-1]:  # down to the nested model that holds the key
        hint = model.model_fields[part].annotation if model is not None and part in model.model_fields else None
        model = next((a for a in (hint, *typing.get_args(hint)) if isinstance(a, type)
                      and issubclass(a, pydantic.BaseModel)), None)
    if model is None:
        return None
    known = [name for field, info in model.model_fields.items() for name in (field, info.alias) if name]
    near = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
    return near[0] if near else None


def _ds_model(name: str):
    """DeepSpeed's pydantic config model of that class name, or None."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    found, todo = None, [DeepSpeedConfigModel]
    while todo and found is None:
        cls = todo.pop()
        found = cls if cls.__name__ == name else None
        todo += cls.__subclasses__()
    return found


def resolve_deepspeed(ds: dict, max_steps: int, has_gpu: bool, deepcompile: bool = False) -> dict:
    """DeepSpeed's section as it will be run: project section removed, schedule length, DeepCompile's switch
    (qwen_edit.train.deepcompile), DeepSpeed's own progress report and throughput timer off unless the config sets
    them, and CPU choices filled."""
    ds = json.loads(json.dumps({k: v for k, v in ds.items() if k != PROJECT_KEY}))
    if deepcompile:
        ds.setdefault("compile", {})["deepcompile"] = True
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.setdefault("steps_per_print", 10**9)  # progress goes through our own logger
    # DeepSpeed's throughput timer synchronises the device at every forward and every step to time them, for a
    # report that steps_per_print above never prints; the step times come from our own CUDA events.
    ds.setdefault("timers", {"throughput": {"enabled": False}})
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


def check_deepcompile(project: ProjectConfig, ds: dict, has_gpu: bool, problems: list[str]) -> None:
    """qwen_edit.train.deepcompile against what DeepCompile in DeepSpeed 0.19.8 can run: a CUDA GPU (its op is
    built for CUDA only: deepspeed.compile.util.is_deepcompile_supported), ZeRO stage 1 or 2 (its passes; at stage 0
    DeepSpeed falls back to a plain torch.compile), the zero2 mode, the whole transformer in one compiled module
    (no per-block compile, no offloaded blocks, whose copies run from hooks, no kept attention, whose stash is
    Python state inside a checkpoint), and gradients on the GPU (its reduction replaces the hooks that copy them to
    the host under optimizer offload). DeepSpeed's own compile.deepcompile key is the project key's output."""
    p, t = f"{PROJECT_KEY}.train.deepcompile", project.train
    section = ds.get("compile") if isinstance(ds.get("compile"), dict) else {}
    if "deepcompile" in section and section["deepcompile"] != t.deepcompile:
        problems.append(f"compile.deepcompile: DeepCompile is switched by {p} ({json.dumps(t.deepcompile)} here); "
                        "remove compile.deepcompile from the DeepSpeed section")
    if not t.deepcompile:
        return
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    refused = {
        "this machine has no CUDA GPU; DeepCompile runs on CUDA GPUs only": not has_gpu,
        f"zero_optimization.stage is {zero.get('stage', 0)}; DeepCompile runs with stage 1 or 2":
            zero.get("stage", 0) not in (1, 2),
        f"parallel.mode is {project.parallel.mode!r}; DeepCompile runs in the zero2 mode":
            project.parallel.mode != "zero2",
        "train.compile is true; the engine compiles the whole transformer instead, set compile to false":
            t.compile,
        f"train.offload_blocks is {t.offload_blocks}; set it to 0": t.offload_blocks != 0,
        "train.gradient_checkpointing keeps attention outputs (train.kept_attention_blocks "
        f"{t.kept_attention_blocks}); set kept_attention_blocks to 0": t.gradient_checkpointing
        and t.kept_attention_blocks != 0,
        "zero_optimization.offload_optimizer moves the optimizer to the host; remove it":
            offload.get("device", "none") in ("cpu", "nvme") or bool(zero.get("cpu_offload")),
    }
    problems += [f"{p}: {why} (or set deepcompile to false)" for why, bad in refused.items() if bad]
