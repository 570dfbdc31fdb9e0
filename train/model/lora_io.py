"""Read LoRA files written by other trainers into our peft adapter (qwen_edit.lora.init_from).

The key layouts are read as the model family's pipelines read them: its LoRA pipeline's `lora_state_dict` (the
family's LoraKeys.pipeline_class; for Qwen-Image, QwenImageEditPipeline's, which every Qwen-Image pipeline inherits
from diffusers' QwenImageLoraLoaderMixin and which calls lora_conversion_utils'
`_convert_non_diffusers_qwen_lora_to_diffusers`) turns the file into diffusers keys, and peft's
`set_peft_model_state_dict` puts them into the adapter, as `load_lora_weights` does. So a file means the same here
as in `train.infer --lora`. docs/export.md lists the layouts this covers.

What stays here is what diffusers does not do before it loads: refuse damaged values, name keys that land
nowhere (diffusers warns, or drops them) and ranks that differ from the config (diffusers would make a new adapter
of the file's rank), and keep the file's scale in an adapter of another alpha.

Scale: the converter folds each `.alpha` into the weights (alpha / rank, split between lora_A and lora_B), and
diffusers' `lora_adapter_metadata` lora_alpha scales on top of that as the pipeline's adapter would; with
neither, the scale is 1 (alpha = rank). When that differs from the adapter's own scale (qwen_edit.lora.alpha /
rank), lora_B is rescaled so that the file's update B @ A x scale is kept (to the rounding of those factors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from train.model import family
from train.model.interface import ModelFamily

# The LoRA keys diffusers' Qwen-Image converter reads: lora_A/B or lora_down/up weights (PEFT's `.default.` adapter
# name dropped) and `.alpha`; it fails on anything else in a non-diffusers file and drops `dora_scale` silently.
_WEIGHT = re.compile(r"\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?P<adapter>\.default)?\.weight$")
_KIND = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}
_PARTNER = {"lora_A": "lora_B", "lora_B": "lora_A", "lora_down": "lora_up", "lora_up": "lora_down"}
PEFT_PREFIX = "base_model.model."
MAX_LISTED = 10


class LoraFileError(ValueError):
    """A LoRA file that cannot start this run (format, rank, targets); the message names the fix."""


@dataclass
class LoadReport:
    """What load_into did, for the log line."""

    loaded: int
    rescaled: int
    not_in_file: list[str]

    def __str__(self) -> str:
        text = f"LoRA init: {self.loaded} modules loaded"
        if self.rescaled:
            text += f", {self.rescaled} of them rescaled to keep the file's alpha/rank scale"
        if self.not_in_file:
            text += f"; {len(self.not_in_file)} adapter modules are not in the file and keep their fresh init"
        return text


def listed(items: list[str]) -> str:
    """At most MAX_LISTED items, then 'and N more'."""
    head = ", ".join(items[:MAX_LISTED])
    return head + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def key_kind(key: str) -> str:
    """'A' | 'B' | 'alpha' for a key the converter reads; '' for anything else."""
    match = _WEIGHT.search(key)
    if match:
        return _KIND[match["kind"]]
    return "alpha" if key.endswith(".alpha") else ""


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
        kind = key_kind(key)
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


def partner(key: str) -> str:
    """The other matrix's key of a lora_A/B or lora_down/up key, as the same file would write it."""
    return _WEIGHT.sub(lambda m: f".{_PARTNER[m['kind']]}{m['adapter'] or ''}.weight", key)


def unpaired(keys: list[str]) -> list[str]:
    """lora_A/lora_down keys without their lora_B/lora_up (or the reverse), as written in the file: the converter
    fails on them with a KeyError or with its own renamed key, so they are found here first."""
    present = set(keys)
    return sorted(k for k in keys if key_kind(k) in ("A", "B") and partner(k) not in present)


def stand_ins(tensors: dict[str, torch.Tensor], unpaired_keys: list[str]) -> dict[str, torch.Tensor]:
    """The file with each matrix replaced by a float64 (rows, 2) tensor [index, 1] (index 1, 2, ... in file order;
    0 for a partner added to an unpaired key, without which the converter fails) and the alphas kept.

    The converter renames keys and multiplies each matrix by a factor taken from alpha and the rank (lora_A's first
    dimension, kept here), so after conversion column 0 / column 1 names the file key a converted key came from and
    column 1 is the factor diffusers applied to it; no matrix is copied to learn this."""
    out = {partner(k): torch.tensor([[0.0, 1.0]], dtype=torch.float64) for k in unpaired_keys}
    for i, (key, tensor) in enumerate(tensors.items()):
        rows = tensor.shape[0] if tensor.ndim else 1
        out[key] = (tensor.to(torch.float64) if key_kind(key) == "alpha"
                    else torch.tensor([i + 1.0, 1.0], dtype=torch.float64).expand(rows, 2))
    return out


def converted_by_diffusers(tensors: dict[str, torch.Tensor], path: Path, fam: ModelFamily) -> dict[str, torch.Tensor]:
    """`lora_state_dict` of the family's LoRA pipeline (its LoraKeys.pipeline_class) of the file's LoRA keys:
    diffusers keys, alpha folded in."""
    import diffusers

    try:
        return getattr(diffusers, fam.lora.pipeline_class).lora_state_dict(dict(tensors))  # a copy: it pops keys
    except ValueError as e:
        raise LoraFileError(f"qwen_edit.lora.init_from: diffusers' {fam.title} LoRA converter cannot read {path} "
                            f"({e}); a file holds one layout (lora_A/lora_B or lora_down/lora_up keys) of "
                            "docs/export.md") from None


def trace(tensors: dict[str, torch.Tensor], unpaired_keys: list[str], path: Path,
          fam: ModelFamily) -> dict[str, tuple[str, float]]:
    """{converted key: (the file key it comes from, the factor diffusers multiplied it by)}; see stand_ins."""
    keys = list(tensors)
    origin = {}
    for key, t in converted_by_diffusers(stand_ins(tensors, unpaired_keys), path, fam).items():
        index = round((t[0, 0] / t[0, 1]).item())
        if index:  # 0: the partner stand_ins added
            origin[key] = (keys[index - 1], t[0, 1].item())
    return origin


def lora_layers(transformer, adapter_name: str) -> dict[str, object]:
    """{module path: peft LoRA layer} for every module that carries `adapter_name`."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and adapter_name in m.r}


def adapter_key(converted_key: str) -> str:
    """The converted key as peft's adapter state dict names it (`X.lora_A.weight`): without diffusers' `transformer.`
    (load_lora_adapter strips it) and without PeftModel's `base_model.model.`, which set_peft_model_state_dict
    accepts too and the converter leaves on PEFT files."""
    return converted_key.removeprefix("transformer.").removeprefix(PEFT_PREFIX)


def module_of(key: str) -> str:
    """`X` of `X.lora_A.weight`."""
    return key.rsplit(".lora_", 1)[0]


def unmatched(origin: dict[str, tuple[str, float]], transformer, adapter_name: str) -> list[str]:
    """File keys whose converted name is no parameter of the adapter, noting diffusers' reading when it differs."""
    from peft import get_peft_model_state_dict

    expected = get_peft_model_state_dict(transformer, adapter_name=adapter_name)
    modules = {n for n, _ in transformer.named_modules()}
    unknown = []
    for key, (file_key, _) in origin.items():
        name = adapter_key(key)
        if name in expected:
            continue
        notes = [f"read as {key}"] if key != file_key else []
        if module_of(name) in modules:
            notes.append("module has no LoRA in this config")
        unknown.append(file_key + (f" ({'; '.join(notes)})" if notes else ""))
    return unknown


def adapter_setting(transformer, adapter_name: str) -> str:
    """'the config has qwen_edit.lora.rank = r and target_modules [...]' from the adapter's peft config."""
    peft_cfg = transformer.peft_config[adapter_name]
    return f"the config has qwen_edit.lora.rank = {peft_cfg.r} and target_modules {sorted(peft_cfg.target_modules)}"


def verify_keys(unknown: list[str], unpaired_keys: list[str], transformer, adapter_name: str, path: Path,
                any_lora: bool) -> None:
    """Raise LoraFileError when a key matched nothing, the file holds no LoRA or a matrix lacks its partner."""
    if unknown:
        raise LoraFileError(f"qwen_edit.lora.init_from: {len(unknown)} keys of {path} match no LoRA module of the "
                            f"transformer: {listed(unknown)}; {adapter_setting(transformer, adapter_name)}. Add the "
                            "missing modules to qwen_edit.lora.target_modules or remove those keys from the file")
    if not any_lora:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} holds no lora_A/lora_down weights; is it a LoRA file?")
    if unpaired_keys:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} has lora_A without lora_B (or the reverse) for "
                            f"{listed(unpaired_keys)}")


def shape_problems(weights: dict[str, torch.Tensor], layers: dict[str, object],
                   adapter_name: str) -> tuple[list[str], list[str]]:
    """(rank mismatches, other shape mismatches) as 'module: file ... vs adapter ...' lines."""
    ranks, shapes = [], []
    for key in sorted(k for k in weights if k.endswith(".lora_A.weight")):
        name = module_of(key)
        down, up = weights[key], weights[f"{name}.lora_B.weight"]
        a, b = layers[name].lora_A[adapter_name].weight, layers[name].lora_B[adapter_name].weight
        if down.shape[0] != a.shape[0] or up.shape[1] != b.shape[1]:
            ranks.append(f"{name}: rank {down.shape[0]}")
        elif down.shape != a.shape or up.shape != b.shape:
            shapes.append(f"{name}: A {tuple(down.shape)}, B {tuple(up.shape)} vs {tuple(a.shape)}, {tuple(b.shape)}")
    return ranks, shapes


def verify_shapes(weights: dict[str, torch.Tensor], transformer, layers: dict, adapter_name: str, path: Path) -> None:
    """Raise LoraFileError when the file's ranks or matrix shapes differ from the adapter's."""
    ranks, shapes = shape_problems(weights, layers, adapter_name)
    if ranks:
        raise LoraFileError(f"qwen_edit.lora.init_from: the rank of {path} differs from the config for {len(ranks)} "
                            f"modules ({listed(ranks)}); {adapter_setting(transformer, adapter_name)}. Set "
                            "qwen_edit.lora.rank to the file's rank")
    if shapes:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} was made for another model (shapes differ: "
                            f"{listed(shapes)}); use a LoRA of this base model")


def rescale(weights: dict[str, torch.Tensor], factors: dict[str, float], layers: dict, adapter_name: str,
            metadata_alpha: float | None) -> int:
    """Scale lora_B in `weights` from the file's scale to the adapter's; `factors` are diffusers' (by adapter key).
    Returns how many modules end up with other weights than the file's own (diffusers' alpha fold, this rescale)."""
    rescaled = 0
    for key in [k for k in weights if k.endswith(".lora_A.weight")]:
        name, b_key = module_of(key), f"{module_of(key)}.lora_B.weight"
        rank = weights[key].shape[0]
        factor = (metadata_alpha / rank if metadata_alpha is not None else 1.0) / layers[name].scaling[adapter_name]
        if factor != 1:
            weights[b_key] = weights[b_key].float() * factor
        rescaled += factors[key] * factors[b_key] * factor != 1
    return rescaled


def load_into(transformer, path: str | Path, adapter_name: str = "default") -> LoadReport:
    """Load the LoRA file `path` into the existing adapter `adapter_name` of `transformer` (see module doc).

    Every key must land on a LoRA parameter of the adapter with the adapter's rank; otherwise LoraFileError
    names the keys and the config's rank/targets. Adapter modules the file lacks keep their fresh init.
    """
    from peft import set_peft_model_state_dict

    path = Path(path)
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter {adapter_name!r}; call models.add_lora first")
    tensors, metadata = read_file(path)
    problems = value_problems(tensors, metadata)
    if problems:
        raise LoraFileError(f"qwen_edit.lora.init_from: {path} cannot start a run: {'; '.join(problems)}. The file "
                            "is damaged or was saved from a diverged run; use another one")
    # Keys the converter does not read are named here: it would fail naming none of them (or drop dora_scale).
    lora = {k: v for k, v in tensors.items() if key_kind(k) and "dora_scale" not in k}
    unread = [k + (" (DoRA is not supported)" if "dora_scale" in k else "") for k in tensors if k not in lora]
    missing_partner = unpaired(list(lora))
    fam = family.transformer_family(transformer)
    origin = trace(lora, missing_partner, path, fam)
    verify_keys(unread + unmatched(origin, transformer, adapter_name), missing_partner, transformer, adapter_name,
                path, any_lora=bool(origin))
    weights = {adapter_key(k): v for k, v in converted_by_diffusers(lora, path, fam).items()}
    assert weights.keys() == {adapter_key(k) for k in origin}, "diffusers renamed the stand-ins otherwise"
    verify_shapes(weights, transformer, layers, adapter_name, path)
    factors = {adapter_key(k): factor for k, (_, factor) in origin.items()}
    rescaled = rescale(weights, factors, layers, adapter_name, file_alpha(metadata))
    result = set_peft_model_state_dict(transformer, weights, adapter_name=adapter_name)
    assert not result.unexpected_keys, result.unexpected_keys  # unmatched() has refused every other key
    loaded = {module_of(k) for k in weights}
    return LoadReport(len(loaded), rescaled, sorted(set(layers) - loaded))
