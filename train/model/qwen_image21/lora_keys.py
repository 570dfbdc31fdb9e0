"""LoRA targets of the Qwen-Image-2.1 transformer and its export keys: diffusers' and ComfyUI's.

Every block (transformer_blocks.N) has four attention projections (attn.to_q, to_k, to_v, to_out.0) and a SwiGLU MLP
of three (img_mlp.gate_layer and img_mlp.proj, both dim -> 3 dim, and img_mlp.out back); diffusers' LoRA loader
takes them as `transformer.<module>.lora_A.weight` / `.lora_B.weight`.

ComfyUI's 2.1 model keeps the attention's names but fuses the MLP's gate and up projections into one weight,
`img_mlp.gate_up` = [gate rows; up rows], and its LoRA loader reads `diffusion_model.<module>.lora_A.weight`,
`.lora_B.weight` and `.alpha`, scaling B @ A by alpha / rank with the rank read off lora_A. Sources of these names:
ComfyUI's model https://github.com/Comfy-Org/ComfyUI/blob/master/comfy/ldm/qwen_image21/model.py (SwiGLUFeedForward),
its key map https://github.com/Comfy-Org/ComfyUI/blob/master/comfy/lora.py (model_lora_keys_unet: every
`diffusion_model.X.weight` is reachable as `diffusion_model.X`) and weight_adapter/lora.py (the scale), and diffusers'
`convert_qwen_image21_transformer_checkpoint_to_diffusers` (gate rows first).

The fused LoRA is exact: the split pair adds s B_g A_g to the gate rows and s B_u A_u to the up rows (s = alpha /
r); the fused one takes A = [A_g; A_u] (rank 2r) and B = [[B_g, 0], [0, B_u]] (block-diagonal), so B A stacks the two
updates, and alpha 2 alpha keeps the scale s at rank 2r. (A shared A with stacked B is exact only when A_g = A_u.)
"""

from __future__ import annotations

import torch

ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
MLP_TARGETS = ("img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")
DEFAULT_TARGETS = ATTENTION_TARGETS + MLP_TARGETS  # every linear layer of every block, as for the MMDiT
DIFFUSERS_PREFIX = "transformer."
COMFYUI_PREFIX = "diffusion_model."
FUSED = "img_mlp.gate_up"
FUSED_PARTS = ("img_mlp.gate_layer", "img_mlp.proj")  # in the fused weight's row order: gate, then up
_A, _B = ".lora_A.weight", ".lora_B.weight"


def comfyui_state_dict(layers: dict[str, torch.Tensor], alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """ComfyUI's layout of a LoRA given as `X.lora_A.weight` / `X.lora_B.weight` on diffusers modules X (peft's
    state dict, adapter name dropped) trained at `alpha` / `rank`: `diffusion_model.X...` and `X.alpha`, the gate and
    up projections of each block fused into its `img_mlp.gate_up` (the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key in layers:
        if not key.endswith(_A):
            continue
        module = key.removesuffix(_A)
        pair = (layers[key], layers[module + _B])
        part = next((name for name in FUSED_PARTS if module.endswith("." + name)), None)
        if part:
            fused.setdefault(module.removesuffix("." + part), {})[part] = pair
        else:
            _put(out, module, *pair, alpha)
    for block, parts in fused.items():
        _put(out, f"{block}.{FUSED}", *fuse(parts), alpha * sum(a.shape[0] for a, _ in parts.values()) / rank)
    return out


def _put(out: dict, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, alpha: float) -> None:
    out[f"{COMFYUI_PREFIX}{module}{_A}"] = lora_a.contiguous()
    out[f"{COMFYUI_PREFIX}{module}{_B}"] = lora_b.contiguous()
    out[f"{COMFYUI_PREFIX}{module}.alpha"] = torch.tensor(float(alpha))


def fuse(parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of the fused gate_up from {"img_mlp.gate_layer" | "img_mlp.proj": (A, B)}: the As stacked, each B in
    its rows (gate first) and its rank's columns; a part without a LoRA leaves its rows zero."""
    some_b = next(iter(parts.values()))[1]
    rows = some_b.shape[0]
    ranks = [parts[name][0].shape[0] for name in FUSED_PARTS if name in parts]
    lora_b = some_b.new_zeros(2 * rows, sum(ranks))
    column = 0
    for index, name in enumerate(FUSED_PARTS):
        if name in parts:
            part_b = parts[name][1]
            lora_b[index * rows : (index + 1) * rows, column : column + part_b.shape[1]] = part_b
            column += part_b.shape[1]
    lora_a = torch.cat([parts[name][0] for name in FUSED_PARTS if name in parts])
    return lora_a, lora_b


def split_comfyui(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse for a ComfyUI-layout LoRA (ours or another trainer's): each fused `img_mlp.gate_up` LoRA becomes
    two of the same rank and alpha on gate_layer and proj, sharing its A, each with its rows of B (exact: the rows of
    B A are the rows of B times A). Other keys pass unchanged."""
    out = {}
    for key, tensor in state.items():
        module, dot, suffix = key.partition(f".{FUSED}")
        if not dot:
            out[key] = tensor
            continue
        for index, name in enumerate(FUSED_PARTS):
            part = tensor
            if suffix == _B:
                rows = tensor.shape[0] // 2
                part = tensor[index * rows : (index + 1) * rows]
            out[f"{module}.{name}{suffix}"] = part.contiguous()
    return out
