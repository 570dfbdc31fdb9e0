"""The plan's knobs in the config: the keys the config sets itself (which the plan never changes), what DeepSpeed's
section says of its optimizer offload and whether DeepSpeed can offload this run's optimizer, and the choice written
back into the free keys."""

from __future__ import annotations

import json

from train.plan.choice import OFFLOAD_KEY
from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.predict import Choice
from train.plan.sizes import GB, Sizes

PLAN_KEYS = (
    "train.fp8_base",
    "train.fp8_transposed",
    "train.compile",
    "train.gradient_checkpointing",
    "train.checkpoint_blocks",
    "train.offload_blocks",
    "train.kept_attention_blocks",
    "data.cache",
    "inference.vae_tiling",
)
OFFLOADABLE_OPTIMIZERS = ("adam", "adamw")  # DeepSpeed steps these on the host with DeepSpeedCPUAdam


def fixed_settings(cfg) -> dict:
    """{dotted key: value} of the plan's knobs that the config sets itself (cfg.explicit), and OFFLOAD_KEY: whether
    the optimizer is offloaded, when the DeepSpeed section says so itself."""
    project = cfg.project
    fixed = {k: getattr(getattr(project, k.split(".")[0]), k.split(".")[1]) for k in PLAN_KEYS if k in cfg.explicit}
    offloaded = configured_offload(cfg.deepspeed)
    if offloaded is not None:
        fixed[OFFLOAD_KEY] = offloaded
    if project.train.deepcompile:  # what DeepCompile cannot run (train/config/deepspeed.py check_deepcompile)
        fixed.update({"train.offload_blocks": 0, "train.kept_attention_blocks": 0, OFFLOAD_KEY: False})
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


def optimizer_offload_blocker(ds: dict, s: Sizes, host: Host = UNCOUNTED_HOST) -> str | None:
    """Why DeepSpeed's optimizer offload cannot serve this run (None: it can): the optimizer is not Adam/AdamW
    (DeepSpeedCPUAdam), the ZeRO stage is not 1 or 2, or the host lacks the room for the state (each rank holds
    its 1/world_size partition, Sizes.host_state_bytes; the same margin as for offloaded blocks)."""
    optimizer = ds.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in OFFLOADABLE_OPTIMIZERS:
        return (
            f"optimizer.type {json.dumps(optimizer.get('type'))} is not one DeepSpeed steps on the host with "
            'DeepSpeedCPUAdam (Adam, AdamW); use "AdamW" to allow it'
        )
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (1, 2):
        return f"zero_optimization.stage is {stage}; DeepSpeed offloads the optimizer of ZeRO stage 1 or 2"
    need = s.host_state_bytes(host.world_size) * host.ranks_per_node
    if need > host.room_bytes:
        return (
            f"its state needs {need / GB:.1f} GB of host memory on this node and {host.available_bytes / GB:.1f}"
            f" GB is available, less a {host.margin_bytes / GB:.1f} GB margin"
        )
    return None


def config_values(c: Choice, num_blocks: int) -> dict:
    """The config keys (dotted, under qwen_edit) that realise `c` (inference.vae_tiling only with a render)."""
    values = {
        "train.fp8_base": c.fp8_base,
        "train.fp8_transposed": c.fp8_transposed,
        "train.gradient_checkpointing": c.checkpointed > 0,
        "train.checkpoint_blocks": 0 if c.checkpointed in (0, num_blocks) else c.checkpointed,
        "train.offload_blocks": c.offloaded,
        "train.kept_attention_blocks": c.kept_attention,
    }
    if c.vae_tiling is not None:
        values["inference.vae_tiling"] = c.vae_tiling
    return values


def apply(cfg, c: Choice, num_blocks: int) -> None:
    """Write the plan's choice into the config's free knobs (explicit ones are already equal or untouched); the
    optimizer offload goes into the DeepSpeed section the engine is built with."""
    project = cfg.project
    if c.offload_optimizer and configured_offload(cfg.deepspeed) is None:
        zero = cfg.deepspeed.setdefault("zero_optimization", {})
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    values = config_values(c, num_blocks)
    if c.cached and project.data.cache == "off":
        values["data.cache"] = "auto"
    for dotted, value in values.items():
        if dotted in cfg.explicit:
            continue
        section, name = dotted.split(".")
        setattr(getattr(project, section), name, value)
    if "train.compile" not in cfg.explicit and not project.train.deepcompile:  # DeepCompile compiles the whole model
        project.train.compile = True
    project.train.fp8_fast_accum = planned_fast_accum(cfg, project.train.fp8_base)


def planned_fast_accum(cfg, fp8_base: bool) -> bool:
    """train.fp8_fast_accum as the plan runs it: the config's value where it sets the key, otherwise on with an fp8
    base (the frozen base's fp8 matmuls accumulate without cuBLAS's periodic fp32 promotion; docs/perf_notes.md)."""
    return cfg.project.train.fp8_fast_accum if "train.fp8_fast_accum" in cfg.explicit else fp8_base
