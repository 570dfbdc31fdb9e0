"""What a resume changes against its checkpoint: settings it cannot honour (refused), settings recorded in
OUTPUT/config_changes.jsonl, a re-stretched learning-rate schedule, and rows that changed since the save."""

from __future__ import annotations

import json

from train.runtime.checkpoint_files import ResumeError

STRETCHED_SCHEDULES = ("WarmupDecayLR", "WarmupCosineLR")  # their length is filled from train.max_steps


def saved_max_steps(state: dict) -> int | None:
    """train.max_steps of the run that saved `state` (None when it was saved before configs were stored)."""
    return (state.get("config") or {}).get("qwen_edit", {}).get("train", {}).get("max_steps")


def schedule_note(state: dict, max_steps: int, step: int, scheduler) -> str | None:
    """A warning when a resume with another train.max_steps changes the LR schedule, or None when nothing changes.

    DeepSpeed's schedulers save only their position (last_batch_iteration); the length of WarmupDecayLR and
    WarmupCosineLR comes from the config, i.e. from the new max_steps, so the rest of the curve is re-stretched
    over the new length and the learning rate moves (up, for a longer run) from where the saved run left it. The
    two rates are `scheduler`'s own formula (the loaded DeepSpeed scheduler) over the new and the saved length.
    """
    saved = saved_max_steps(state)
    kind = ((state.get("config") or {}).get("scheduler") or {}).get("type")
    if saved is None or saved == max_steps or kind not in STRETCHED_SCHEDULES or scheduler is None:
        return None
    now, length = scheduler.get_lr()[0], scheduler.total_num_steps
    scheduler.total_num_steps = saved  # the saved curve: the same scheduler over the saved length, for one read
    try:
        before = scheduler.get_lr()[0]
    finally:
        scheduler.total_num_steps = length
    return (
        f"warning: resume: train.max_steps is {max_steps}, the checkpoint's run had {saved}; DeepSpeed's {kind} "
        f"is re-stretched over {max_steps} steps, so the learning rate of step {step + 1} is {now:.3g} instead of "
        f"{before:.3g} on the saved curve{f' ({now / before:.3g}x)' if before else ''}. To keep the saved curve, "
        "resume with the old --max_steps; to go on at a fixed rate, see docs/checkpoints.md, 'Extending a run'"
    )


# Settings a resume cannot honour: the checkpoint's tensors, ZeRO shards or optimizer state are laid out by them.
FIXED_KEYS = (
    "qwen_edit.train.mode",
    "qwen_edit.lora.rank",
    "qwen_edit.lora.alpha",
    "qwen_edit.lora.target_modules",
    "qwen_edit.model.variant",
    "qwen_edit.parallel.mode",
    "qwen_edit.train.deepcompile",  # freezes the weights no output reaches (prepare.freeze_unreached)
    "zero_optimization.stage",
    "bf16.enabled",
    "fp16.enabled",
    "optimizer.type",
)
# Settings expected to differ on a resume (a longer run, a moved output directory): not reported.
FREE_KEYS = ("qwen_edit.train.max_steps", "scheduler.params.total_num_steps", "qwen_edit.output.dir")


def _flat(cfg: dict, prefix: str = "") -> dict:
    """{'a.b.c': value} of a nested config dict (lists are values)."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(state: dict, config: dict, tag: str) -> dict[str, list]:
    """{key: [saved, now]} of the settings that differ between the checkpoint's stored config and `config` (the
    resolved config of this run), for the record; ResumeError naming every key of FIXED_KEYS that changed."""
    if not isinstance(state.get("config"), dict):
        return {}  # saved before configs were stored: nothing to compare
    saved, now = _flat(state["config"]), _flat(config)
    changed = {
        k: [saved.get(k), now.get(k)]
        for k in sorted(saved.keys() | now.keys())
        if saved.get(k) != now.get(k) and k not in FREE_KEYS
    }
    fixed = {k: v for k, v in changed.items() if k in FIXED_KEYS}
    if fixed:
        listed = "; ".join(
            f"{k}: {json.dumps(old)} in the checkpoint, {json.dumps(new)} now" for k, (old, new) in fixed.items()
        )
        raise ResumeError(
            f"--resume {tag}: the checkpoint cannot continue with these changed settings ({listed}); "
            "its weights and optimizer state are laid out by them. Set them back to resume, or export "
            f"the weights (python -m train.export --checkpoint OUTPUT/{tag} --out DIR) and start a new "
            "run from them (qwen_edit.lora.init_from = DIR/pytorch_lora_weights.safetensors)"
        )
    return changed


def data_change(state: dict, data: dict, tag: str, step: int) -> str | None:
    """The warning for a resume over rows that changed since the checkpoint (`data`: rows.fingerprint of this run's
    rows; the checkpoint's in its trainer_state), or None (the same rows, or a checkpoint that did not record
    them). The run goes on at the checkpoint's step with the rows as they are now."""
    saved = state.get("data")
    if not isinstance(saved, dict) or saved == data:
        return None
    return (
        f"warning: the dataset changed since {tag}: {saved.get('rows')} rows then, {data['rows']} now (rows "
        f"added, removed or edited). The run goes on at step {step} with the rows as they are now, at the same "
        "place in its epoch counted in the new rows, so the rest of this epoch is not the one the checkpoint's "
        "rows would have given; to continue exactly, restore the data it was trained on"
    )
