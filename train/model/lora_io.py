"""Read LoRA files written by other trainers into our peft adapter (qwen_edit.lora.init_from).

Accepted key layouts (one file may mix prefixes; the weights are the same two matrices in each):

    diffusers   transformer.X.lora_A.weight / .lora_B.weight              (our own export)
    PEFT        base_model.model.X.lora_A.default.weight, X.lora_A.default.weight (DiffSynth-Studio)
    ComfyUI     diffusion_model.X.lora_A.weight, or .lora_down/.lora_up.weight, with X.alpha
    kohya       lora_unet_<X with '.' -> '_'>.lora_down.weight / .lora_up.weight / .alpha

X is a module path such as `transformer_blocks.0.attn.to_q`. Kohya names are resolved against the
transformer's actual module names (so `img_mlp_net_0_proj` becomes `img_mlp.net.0.proj`, not `img.mlp...`).

Scale: a LoRA's update is (alpha / rank) * B @ A. A file's alpha comes from its `.alpha` keys, else from
diffusers' `lora_adapter_metadata`, else it is taken to equal the rank (the diffusers/PEFT convention, scale 1).
When that differs from the adapter's own scale (qwen_edit.lora.alpha / rank), lora_B is rescaled so the
effective update of the file is preserved exactly; training then continues from the same model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

PREFIXES = ("base_model.model.", "transformer.", "diffusion_model.", "lora_unet_")
_WEIGHT = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.[A-Za-z_]\w*)?\.weight$")
_KIND = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}
MAX_LISTED = 10


class LoraFileError(ValueError):
    """A LoRA file that cannot start this run (format, rank, targets); the message names the fix."""


@dataclass
class LoraFile:
    """A LoRA file normalised to module paths: A/B matrices and optional alpha per module."""

    down: dict[str, torch.Tensor] = field(default_factory=dict)
    up: dict[str, torch.Tensor] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    """Keys (as written in the file) that are no LoRA A/B/alpha of a module carrying our adapter."""


@dataclass
class LoadReport:
    """What load_into did, for the log line."""

    loaded: int
    rescaled: int
    not_in_file: list[str]

    def __str__(self) -> str:
        text = f"LoRA init: {self.loaded} modules loaded"
        if self.rescaled:
            text += f", lora_B of {self.rescaled} rescaled to keep the file's alpha/rank scale"
        if self.not_in_file:
            text += f"; {len(self.not_in_file)} adapter modules are not in the file and keep their fresh init"
        return text


def listed(items: list[str]) -> str:
    """At most MAX_LISTED items, then 'and N more'."""
    head = ", ".join(items[:MAX_LISTED])
    return head + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def strip_prefix(key: str) -> str:
    """Key without the trainer-specific prefixes (PEFT's base_model.model., diffusers', ComfyUI's, kohya's)."""
    for prefix in PREFIXES:
        key = key.removeprefix(prefix)
    return key


def parse_key(key: str) -> tuple[str | None, str]:
    """(module as written, 'A' | 'B' | 'alpha') of a LoRA key; (None, '') for anything else."""
    name = strip_prefix(key)
    match = _WEIGHT.match(name)
    if match:
        return match["module"], _KIND[match["kind"]]
    if name.endswith(".alpha"):
        return name.removesuffix(".alpha"), "alpha"
    return None, ""


def resolver(module_names: list[str]):
    """Map a module path or its kohya-flattened form (dots as underscores) to the module path, or None."""
    exact = set(module_names)
    flat: dict[str, str | None] = {}
    for name in module_names:
        key = name.replace(".", "_")
        flat[key] = None if key in flat and flat[key] != name else name  # None: ambiguous when flattened

    def resolve(module: str) -> str | None:
        return module if module in exact else flat.get(module)

    return resolve


def file_alpha(metadata: dict[str, str] | None) -> float | None:
    """lora_alpha from diffusers' `lora_adapter_metadata` header, when the file carries one."""
    raw = (metadata or {}).get("lora_adapter_metadata")
    if not raw:
        return None
    meta = json.loads(raw)
    patterns = {k: v for k, v in meta.items() if k.endswith("alpha_pattern") and v}
    if patterns:
        raise ValueError(f"per-module alpha_pattern in lora_adapter_metadata is not supported: {patterns}; "
                         "fold alpha/rank into lora_B or write .alpha keys per module")
    alphas = [v for k, v in meta.items() if k.split(".")[-1] == "lora_alpha"]
    return float(alphas[0]) if alphas else None


def _alpha_value(tensor: torch.Tensor) -> float | None:
    """An alpha key's value when it is one real number (not a bool), else None."""
    if tensor.numel() != 1 or tensor.dtype == torch.bool or tensor.is_complex():
        return None
    return float(tensor.item())


def value_problems(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> list[str]:
    """What makes a file's values unusable as a LoRA, by key: A/B matrices that are not floating point (bool,
    integer), NaN or infinite entries in any floating-point tensor, alphas that are not one finite number > 0 (a
    zero alpha silences the LoRA, a NaN one turns every image black)."""
    not_float, nonfinite, bad_alpha = [], [], []
    for key, tensor in tensors.items():
        kind = parse_key(key)[1]
        if kind == "alpha":
            value = _alpha_value(tensor)
            if value is None or not math.isfinite(value) or value <= 0:
                bad_alpha.append(f"{key} = {tensor.tolist() if tensor.numel() <= 4 else tuple(tensor.shape)}")
        elif tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                nonfinite.append(key)
        elif kind in ("A", "B"):
            not_float.append(f"{key} ({str(tensor.dtype).removeprefix('torch.')})")
    problems = []
    if not_float:
        problems.append(f"{len(not_float)} LoRA matrices are not floating point: {listed(not_float)}")
    if nonfinite:
        problems.append(f"{len(nonfinite)} tensors hold NaN or infinite values: {listed(nonfinite)}")
    if bad_alpha:
        problems.append(f"{len(bad_alpha)} alphas are not a finite number > 0: {listed(bad_alpha)}")
    try:
        alpha = file_alpha(metadata)
    except (ValueError, json.JSONDecodeError) as e:
        problems.append(f"its lora_adapter_metadata cannot be used ({e})")
    else:
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            problems.append(f"lora_alpha {alpha} in its lora_adapter_metadata is not a finite number > 0")
    return problems


def check_file(path: str | Path) -> list[str]:
    """value_problems of a LoRA .safetensors file, or why it cannot be read ([] = fine); for train.infer --lora."""
    try:
        tensors, metadata = read_file(path)
    except LoraFileError as e:
        return [str(e).removeprefix("qwen_edit.lora.init_from: ")]
    return [f"{path}: {problem}; the file is damaged or was saved from a diverged run, use another one"
            for problem in value_problems(tensors, metadata)]


def normalise(state_dict: dict[str, torch.Tensor], lora_modules: list[str], all_modules: list[str]) -> LoraFile:
    """Sort the file's keys into A/B/alpha per adapter module; everything else lands in `unknown`."""
    resolve_lora, resolve_any = resolver(lora_modules), resolver(all_modules)
    out = LoraFile()
    for key, tensor in state_dict.items():
        module, kind = parse_key(key)
        target = resolve_lora(module) if module else None
        if target is None:
            where = "" if module is None or resolve_any(module) is None else " (module has no LoRA in this config)"
            out.unknown.append(key + where)
        elif kind == "alpha":
            out.alpha[target] = _alpha_value(tensor)  # value_problems has refused anything but a number > 0
        else:
            (out.down if kind == "A" else out.up)[target] = tensor
    return out


def read_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Tensors and header metadata of a .safetensors file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.suffix != ".safetensors":
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} is not a .safetensors file; convert it to safetensors")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    except (OSError, SafetensorError) as e:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} cannot be read as safetensors ({e}); the file is "
                            "damaged or not a LoRA") from None


def lora_layers(transformer, adapter_name: str) -> dict[str, object]:
    """{module path: peft LoRA layer} for every module that carries `adapter_name`."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and adapter_name in m.r}


def check_pairs(lf: LoraFile) -> list[str]:
    """Modules with only one of the two matrices."""
    return sorted(set(lf.down) ^ set(lf.up))


def shape_problems(lf: LoraFile, layers: dict[str, object], adapter_name: str) -> tuple[list[str], list[str]]:
    """(rank mismatches, other shape mismatches) as 'module: file ... vs adapter ...' lines."""
    ranks, shapes = [], []
    for name, down in lf.down.items():
        a, b = layers[name].lora_A[adapter_name].weight, layers[name].lora_B[adapter_name].weight
        up = lf.up[name]
        if down.shape[0] != a.shape[0] or up.shape[1] != b.shape[1]:
            ranks.append(f"{name}: rank {down.shape[0]}")
        elif down.shape != a.shape or up.shape != b.shape:
            shapes.append(f"{name}: A {tuple(down.shape)}, B {tuple(up.shape)} vs {tuple(a.shape)}, {tuple(b.shape)}")
    return ranks, shapes


def adapter_setting(transformer, adapter_name: str) -> str:
    """'the config has qwen_edit.lora.rank = r and target_modules [...]' from the adapter's peft config."""
    peft_cfg = transformer.peft_config[adapter_name]
    return f"the config has qwen_edit.lora.rank = {peft_cfg.r} and target_modules {sorted(peft_cfg.target_modules)}"


def verify(lf: LoraFile, transformer, layers: dict[str, object], adapter_name: str, path: Path) -> None:
    """Raise ValueError when a key matched nothing, a pair is incomplete, or ranks/shapes differ."""
    setting = adapter_setting(transformer, adapter_name)
    if lf.unknown:
        raise LoraFileError(f"qwen_edit.lora.init_from: {len(lf.unknown)} keys of {path} match no LoRA module of the "
                         f"transformer: {listed(lf.unknown)}; {setting}. Add the missing modules to "
                         "qwen_edit.lora.target_modules or remove those keys from the file")
    if not lf.down:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} holds no lora_A/lora_down weights; is it a LoRA file?")
    unpaired = check_pairs(lf)
    if unpaired:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} has lora_A without lora_B (or the reverse) for "
                         f"{listed(unpaired)}")
    ranks, shapes = shape_problems(lf, layers, adapter_name)
    if ranks:
        raise LoraFileError(f"qwen_edit.lora.init_from: the rank of {path} differs from the config for {len(ranks)} "
                         f"modules ({listed(ranks)}); {setting}. Set qwen_edit.lora.rank to the file's rank")
    if shapes:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} was made for another model (shapes differ: "
                         f"{listed(shapes)}); use a LoRA of this base model")


@torch.no_grad()
def copy_weights(lf: LoraFile, layers: dict[str, object], adapter_name: str, default_alpha: float | None) -> int:
    """Copy A and (rescaled) B into the adapter; returns how many modules needed a rescale."""
    rescaled = 0
    for name, down in lf.down.items():
        layer = layers[name]
        rank = down.shape[0]
        alpha = lf.alpha.get(name, default_alpha if default_alpha is not None else rank)
        factor = (alpha / rank) / layer.scaling[adapter_name]
        up = lf.up[name].float() * factor if factor != 1 else lf.up[name]
        rescaled += factor != 1
        layer.lora_A[adapter_name].weight.copy_(down)
        layer.lora_B[adapter_name].weight.copy_(up)
    return rescaled


def load_into(transformer, path: str | Path, adapter_name: str = "default") -> LoadReport:
    """Load the LoRA file `path` into the existing adapter `adapter_name` of `transformer` (see module doc).

    Every key must land on a LoRA parameter of the adapter with the adapter's rank; otherwise ValueError
    names the keys and the config's rank/targets. Adapter modules the file lacks keep their fresh init.
    """
    path = Path(path)
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter {adapter_name!r}; call models.add_lora first")
    tensors, metadata = read_file(path)
    problems = value_problems(tensors, metadata)
    if problems:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} cannot start a run: {'; '.join(problems)}. The file "
                            "is damaged or was saved from a diverged run; use another one")
    lf = normalise(tensors, list(layers), [n for n, _ in transformer.named_modules()])
    verify(lf, transformer, layers, adapter_name, path)
    rescaled = copy_weights(lf, layers, adapter_name, file_alpha(metadata))
    return LoadReport(len(lf.down), rescaled, sorted(set(layers) - set(lf.down)))
