"""Every weight that leaves: the LoRA (diffusers / ComfyUI layout) or full-transformer export of a live model (end
of training, output.export_every_steps) and of a saved DeepSpeed checkpoint, without training or a process group
(the command train/export.py).

The fp32 master weights are consolidated from the ZeRO-2 optimizer shards with DeepSpeed's own
`zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`; the checkpoint's client_state says how it was
trained ({"step": N, "config": resolved config}). A checkpoint of a decoder cut over D stages
(parallel.decoder_cuts, docs/model_parallel.md) holds one file set per stage (mp_rank_00 .. mp_rank_D-1, each
with its optimizer shards); each stage is consolidated on its own and the stages' weights, which never overlap,
are merged into one export. Outputs:

    LoRA, diffusers   DIR/pytorch_lora_weights.safetensors   `transformer.X.lora_A.weight` (pipe.load_lora_weights)
    LoRA, comfyui     DIR/lora_comfyui.safetensors          the model family's ComfyUI keys (Qwen-Image:
                                                             `diffusion_model.X.lora_A.weight` + `X.alpha`)
    full              DIR/transformer/                       a diffusers transformer directory (the base model's class)

The key layouts are the model family's (`keys`: its LoraKeys, train/model/interface.py); this module writes them.

Scale: peft applies alpha / rank to B @ A. The diffusers layout has no alpha (loaders use scale 1), so when
lora.alpha != lora.rank the scale is folded into lora_B; the ComfyUI layout keeps B as trained and writes alpha.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from train.runtime.checkpoint import STATE_FILE, previous_complete
from train.runtime.checkpoint_files import CheckpointFileError, safe_load, weights_only_consolidation

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_SHARDS = "*zero_pp_rank_*_optim_states.pt"
COMFYUI_WEIGHT_NAME = "lora_comfyui.safetensors"
DTYPES = ("float32", "bfloat16", "float16")
STAGE_PREFIX = "transformer."  # a model-parallel decoder stage's parameter names: the whole model's, under .transformer
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.[^.]+\.weight$")


def read_config(ckpt: Path) -> dict:
    """The resolved training config stored in the checkpoint's client_state; ValueError naming the fix."""
    states = ckpt / MODEL_STATES
    if not states.is_file():
        if not ckpt.is_dir():
            hint = "the directory does not exist; pass OUT/global_stepN of a training run"
        elif (ckpt / "latest").is_file():
            hint = f"it looks like a training output directory; pass {ckpt}/global_stepN"
        else:
            hint = "pass the global_stepN directory of a training output"
        raise ValueError(f"--checkpoint {ckpt}: no {MODEL_STATES} there; {hint}")
    client = safe_load(states, map_location="cpu", mmap=True)  # mmap: weights stay on disk
    cfg = client.get("config")
    if not isinstance(cfg, dict) or "step" not in client or "qwen_edit" not in cfg:
        raise ValueError(f"{states} has no qwen-edit-trainer client_state (keys 'step' and 'config' with a "
                         "'qwen_edit' section); it was not saved by train/main.py. Use DeepSpeed's "
                         "zero_to_fp32.py for other checkpoints")
    return cfg


def consolidate(ckpt: Path, num_stages: int = 1) -> dict[str, torch.Tensor]:
    """fp32 trainable weights (plus persistent buffers) merged from all ZeRO shards, by DeepSpeed's own code;
    over every stage of a decoder cut when `num_stages` > 1 (names as in the whole transformer)."""
    shards = sorted(ckpt.glob(OPTIM_SHARDS))
    if not shards:
        raise ValueError(f"--checkpoint {ckpt}: no ZeRO optimizer shards ({OPTIM_SHARDS}) hold the fp32 master "
                         "weights; export needs a checkpoint trained with zero_optimization.stage 1 or 2")
    print(f"consolidating fp32 master weights from {len(shards)} ZeRO shard(s) of {ckpt}", flush=True)
    with weights_only_consolidation():  # zero_to_fp32's own loads would unpickle anything (checkpoint_files.py)
        return _consolidate_stages(ckpt, num_stages)


def _consolidate_stages(ckpt: Path, num_stages: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if num_stages == 1:
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name,
                                                        exclude_frozen_parameters=True)
    merged: dict[str, torch.Tensor] = {}
    for stage, files in enumerate(stage_files(ckpt, num_stages)):
        # zero_to_fp32 reads every *_model_states.pt / *_optim_states.pt of a directory as one model: give it a
        # directory that holds only this stage's files (links), so that only public DeepSpeed API is used.
        with tempfile.TemporaryDirectory() as view:
            (Path(view) / ckpt.name).mkdir()
            for f in files:
                (Path(view) / ckpt.name / f.name).symlink_to(f.resolve())
            state = get_fp32_state_dict_from_zero_checkpoint(view, tag=ckpt.name, exclude_frozen_parameters=True)
        assert all(k.startswith(STAGE_PREFIX) for k in state), f"stage {stage}: {sorted(state)[:5]}"
        assert not merged.keys() & {k.removeprefix(STAGE_PREFIX) for k in state}, "decoder stages share weights"
        merged.update((k.removeprefix(STAGE_PREFIX), v) for k, v in state.items())
    return merged


def stage_files(ckpt: Path, num_stages: int) -> list[list[Path]]:
    """Per decoder stage (DeepSpeed's model-parallel rank KK): mp_rank_KK_model_states.pt and its ZeRO shards."""
    found = sorted(p.name for p in ckpt.glob("mp_rank_*_model_states.pt"))
    wanted = [f"mp_rank_{k:02d}_model_states.pt" for k in range(num_stages)]
    if found != wanted:
        raise ValueError(f"--checkpoint {ckpt}: a decoder cut over {num_stages} stages saves {wanted}, found "
                         f"{found}; the checkpoint is incomplete (a stage's save failed), export an earlier one")
    stages = []
    for k, name in enumerate(wanted):
        shards = sorted(ckpt.glob(f"*zero_pp_rank_*_mp_rank_{k:02d}_optim_states.pt"))
        if not shards:
            raise ValueError(f"--checkpoint {ckpt}: stage mp_rank_{k:02d} has no ZeRO optimizer shards; the "
                             "checkpoint is incomplete, export an earlier one")
        stages.append([ckpt / name, *shards])
    return stages


def num_decoder_stages(cfg: dict) -> int:
    """Decoder stages the checkpoint was trained with (1 unless parallel.decoder_cuts cut the transformer)."""
    parallel = cfg["qwen_edit"].get("parallel", {})
    if parallel.get("mode") != "model_parallel":
        return 1
    return len(parallel.get("decoder_cuts", [])) + 1


def lora_layers(state: dict[str, torch.Tensor], ckpt: Path) -> dict[str, torch.Tensor]:
    """peft adapter weights as `X.lora_A.weight` (adapter name dropped), as peft's get_peft_model_state_dict."""
    layers = {}
    for key, tensor in state.items():
        match = _PEFT_KEY.match(key)
        if match:
            layers[f"{match['module']}.{match['kind']}.weight"] = tensor
    if not layers:
        raise ValueError(f"{ckpt} was trained with train.mode 'lora' but holds no lora_A/lora_B weights")
    return layers


def lora_scale(cfg: dict) -> tuple[float, int]:
    """(lora.alpha, lora.rank) from the resolved config."""
    lora = cfg["qwen_edit"]["lora"]
    return float(lora["alpha"]), int(lora["rank"])


def write_comfyui_lora(layers: dict[str, torch.Tensor], out: Path, alpha: float, dtype: torch.dtype,
                      metadata: dict[str, str] | None = None, *, keys) -> Path:
    """DIR/lora_comfyui.safetensors in the family's ComfyUI layout (`keys.comfyui`: the matrices and their alpha,
    which ComfyUI's LoRA loader scales by alpha / rank; the rank is the lora_A matrices' rows)."""
    from safetensors.torch import save_file

    rank = next(v.shape[0] for k, v in layers.items() if k.endswith(".lora_A.weight"))
    sd = keys.comfyui({k: v.to(dtype).contiguous() for k, v in layers.items()}, alpha, rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, out / COMFYUI_WEIGHT_NAME, metadata={"format": "pt", **(metadata or {})})
    apply_umask(out / COMFYUI_WEIGHT_NAME)
    return out / COMFYUI_WEIGHT_NAME


def write_full(state: dict[str, torch.Tensor], model_dir: Path, out: Path, dtype: torch.dtype,
               metadata: dict[str, str] | None = None, *, transformer_class: str) -> Path:
    """DIR/transformer/: config from the base model, weights from the consolidated state dict, in the family's
    diffusers `transformer_class`."""
    import diffusers

    config_dir = model_dir / "transformer"
    if not (config_dir / "config.json").is_file():
        raise ValueError(f"base model {model_dir} has no transformer/config.json; pass --model DIR with the base "
                         "model the checkpoint was trained from")
    cls = getattr(diffusers, transformer_class)
    with torch.device("meta"):  # no 20 B random init: the weights come from the checkpoint
        model = cls.from_config(cls.load_config(config_dir))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit {config_dir}/config.json: missing {missing[:10]}, "
                         f"unexpected {unexpected[:10]}; pass --model DIR with the base model it was trained from")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    print(f"writing {len(state)} tensors to {out / 'transformer'}", flush=True)
    return export_full(model, out, metadata)


def export(checkpoint: str | Path, out: str | Path, fmt: str = "diffusers", dtype: str = "float32",
           model: str | Path | None = None, overwrite: bool = False, *, family_of) -> Path:
    """Write the export of `checkpoint` into `out`; returns the file or directory written. An export already there
    is replaced only with `overwrite` (ValueError naming it otherwise, before anything is read). `family_of(variant,
    model_dir)`: the trained model's family (train/model/family.py family_for), which names its LoRA keys and
    transformer class."""
    ckpt, out = Path(checkpoint), Path(out)
    try:
        return _export(ckpt, out, fmt, dtype, model, overwrite, family_of)
    except CheckpointFileError as e:  # a damaged or refused file: name a complete checkpoint to export instead
        earlier = previous_complete(ckpt.parent, ckpt.name)
        hint = f"; export the previous complete checkpoint instead: --checkpoint {ckpt.parent / earlier}" if earlier \
            else ""
        raise CheckpointFileError(f"{e}{hint}") from None


def _export(ckpt: Path, out: Path, fmt: str, dtype: str, model: str | Path | None, overwrite: bool,
            family_of) -> Path:
    cfg = read_config(ckpt)
    mode = cfg["qwen_edit"]["train"]["mode"]
    if mode == "full" and fmt != "diffusers":
        raise ValueError(f"--format {fmt}: a full fine-tune exports only as a diffusers transformer directory; "
                         "use --format diffusers")
    target = out / ("transformer" if mode == "full" else COMFYUI_WEIGHT_NAME if fmt == "comfyui" else LORA_WEIGHT_NAME)
    if target.exists() and not overwrite:
        raise ValueError(f"--out {out} already holds an export ({target}); pass --overwrite to replace it, or "
                         "choose another --out")
    if target.is_dir():  # --overwrite of a full export: no shard of the old one may stay beside the new ones
        shutil.rmtree(target)
    state = consolidate(ckpt, num_decoder_stages(cfg))
    torch_dtype = getattr(torch, dtype)
    variant, model_dir = checkpoint_variant(ckpt, cfg), Path(model or cfg["qwen_edit"]["model"]["path"])
    metadata = export_metadata(cfg, variant, step_of(ckpt))
    fam = family_of(variant, model_dir)
    if mode == "full":
        return write_full(state, model_dir, out, torch_dtype, metadata, transformer_class=fam.transformer_class)
    layers = lora_layers(state, ckpt)
    alpha, rank = lora_scale(cfg)
    keys = fam.lora
    if fmt == "comfyui":
        return write_comfyui_lora(layers, out, alpha, torch_dtype, metadata, keys=keys)
    return write_diffusers_lora(layers, out, alpha, rank, torch_dtype, metadata, keys=keys)


def checkpoint_variant(ckpt: Path, cfg: dict) -> str:
    """The variant the run trained (trainer_state.json records the detected one; the config may say "auto")."""
    try:
        saved = json.loads((ckpt / STATE_FILE).read_text()).get("variant")
    except (OSError, ValueError, AttributeError):  # no or a damaged state file: the config's setting
        saved = None
    return saved or cfg["qwen_edit"]["model"].get("variant", "auto")


def step_of(ckpt: Path) -> int:
    """The optimizer step of a checkpoint directory, from its client_state."""
    return int(safe_load(ckpt / MODEL_STATES, map_location="cpu", mmap=True)["step"])


# --- exports of a live model (end of training, export_every_steps) and their writers ------------------------------


def _lora_tensors(transformer) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors where they live (peft's state dict of the live model)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer)


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in _lora_tensors(transformer).items()}


def export_metadata(config: dict, variant: str, step: int) -> dict[str, str]:
    """What an export records about itself (safetensors header entries, all text): the base model and variant,
    the training mode, LoRA rank / alpha / target modules, the step, and a hash of the resolved config."""
    p = config["qwen_edit"]
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"qwen_edit.base_model": str(p["model"]["path"]), "qwen_edit.variant": variant,
            "qwen_edit.train_mode": p["train"]["mode"], "qwen_edit.lora_rank": str(p["lora"]["rank"]),
            "qwen_edit.lora_alpha": str(float(p["lora"]["alpha"])),
            "qwen_edit.target_modules": json.dumps(p["lora"]["target_modules"]), "qwen_edit.step": str(step),
            "qwen_edit.config_sha256": digest}


def user_umask() -> int:
    """The process's umask, read from /proc/self/status where Linux gives it: the only portable way to read it,
    os.umask(0), sets it for a moment, and a file another thread (the metrics writer, a loader) creates then would
    be world-writable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)  # set straight back
    return mask


def apply_umask(path: Path) -> None:
    """Give `path` (a file, or every file below a directory) the permissions the user's umask asks for: safetensors
    (0.8) writes each file as a Rust tempfile::NamedTempFile, created 0600, and renames it into place, which hides an
    export (or a latent cache shard) from the user's group."""
    mode = 0o666 & ~user_umask()
    for f in [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]:
        f.chmod(mode)


def write_diffusers_lora(layers: dict[str, torch.Tensor], out: str | Path, alpha: float, rank: int,
                         dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None, *, keys) -> Path:
    """OUT/pytorch_lora_weights.safetensors (`transformer.X.lora_A.weight` keys) for the pipelines'
    load_lora_weights, written by the family's pipeline (`keys.pipeline_class`), with `metadata` (see
    export_metadata) in its header. The diffusers layout stores no alpha, so alpha / rank is folded into lora_B (the
    header's lora_alpha is the trained one)."""
    import diffusers
    from safetensors.torch import save_file

    def save(weights: dict, filename: str) -> None:  # diffusers' own writer, plus our header entries
        header = {"format": "pt", **(metadata or {})}
        if metadata:
            header["qwen_edit.lora_b_scale_folded"] = str(alpha / rank)
        save_file(weights, filename, metadata=header)

    scale = alpha / rank
    layers = {k: (v * scale if scale != 1 and ".lora_B." in k else v).to(dtype or v.dtype) for k, v in layers.items()}
    writer = getattr(diffusers, keys.pipeline_class)
    writer.save_lora_weights(Path(out), transformer_lora_layers=layers, weight_name=LORA_WEIGHT_NAME,
                             safe_serialization=True, save_function=save)
    apply_umask(Path(out) / LORA_WEIGHT_NAME)
    return Path(out) / LORA_WEIGHT_NAME


def export_lora(transformer, out_dir: str | Path, alpha: float, rank: int,
                metadata: dict[str, str] | None = None, *, keys) -> Path:
    """The end-of-training LoRA export (same layout as `python -m train.export`; `keys`: the family's LoraKeys)."""
    return write_diffusers_lora(lora_state_dict(transformer), out_dir, alpha, rank, metadata=metadata, keys=keys)


def export_bytes(transformer, mode: str) -> int:
    """Bytes of one export of the live `transformer` as export_lora / export_full write it (headers and config
    aside): its LoRA adapter, or (full) every weight and persistent buffer, each in its training dtype."""
    tensors = _lora_tensors(transformer) if mode == "lora" else transformer.state_dict()
    return sum(t.numel() * t.element_size() for t in tensors.values())


EXPORT_INFO = "qwen_edit_export.json"  # a full export's metadata (diffusers writes the shards' headers itself)


def export_full(transformer, out_dir: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """OUT/transformer/: a diffusers transformer directory (config + safetensors), with
    `metadata` in OUT/transformer/qwen_edit_export.json."""
    out = Path(out_dir) / "transformer"
    transformer.save_pretrained(out, safe_serialization=True)
    if metadata:
        (out / EXPORT_INFO).write_text(json.dumps(metadata, indent=2) + "\n")
    apply_umask(out)
    return out
