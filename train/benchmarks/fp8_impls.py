"""The frozen base in fp8 three ways, on the same linears, for `train.bench --fp8_base --fp8_impl`.

- `ours`: train/model/fp8.py. e4m3 weights with per-row scales stored once (optionally also transposed for the
  backward), `torch._scaled_mm` forward and input gradient, no weight gradient, nothing saved for the backward
  but the fp8 weight; modulation linears weight-only (dequantised per call).
- `torchao_training`: torchao.float8's training linear, `convert_to_float8_training` with the "rowwise" recipe
  of `Float8LinearConfig`, on the token linears (peft's base layers). The closest torchao setting that trains:
  its backward gives the input gradient through fp8 GEMMs. What it does with a frozen weight: it keeps the bf16
  weight (no memory saved), quantises it at every call (rowwise along one axis for the forward, along the other
  for the input gradient, so the transposed layout is re-made per step rather than stored), saves the bf16 input
  for the backward, and computes the weight gradient although the weight is frozen (its backward has no
  `needs_input_grad` test; under torch.compile the unused GEMM can be removed as dead code). Modulation linears
  stay bf16 (a one-row input is not what the recipe is for).
- `torchao_inference`: torchao's fp8 inference linears, `quantize_` with
  `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())` on the token linears and
  `Float8WeightOnlyConfig()` on the modulation linears (ours' split). fp8 weights stored once, as ours without the
  transposed copy; the forward is a rowwise scaled matmul (`F.linear` is intercepted at the torch-function level
  and runs on the fp8 data and scales). It is built for inference: whether autograd passes the input gradient
  back through its activation quantisation and the scaled matmul is what the benchmark row shows; torchao refuses
  it on CPUs and on GPUs older than compute capability 8.9.
"""

from __future__ import annotations

import torch

from train.model import family, fp8

IMPLS = ("ours", "torchao_training", "torchao_inference")


def frozen_linears(model: torch.nn.Module, kind: str) -> list[str]:
    """Names of the plain nn.Linear modules (peft's base layers included) that train/model/fp8.py converts as `kind`
    ("token" or "vector"), as the model's family names them."""
    kind_of = family.transformer_family(model).fp8_kind
    return [name for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and ".lora_" not in name
            and kind_of(name.removesuffix(".base_layer")) == kind]


def convert(model: torch.nn.Module, impl: str, keep_transposed: bool = False, fast_accum: bool = False) -> int:
    """Put the frozen block linears of `model` (LoRA already added) in fp8 the `impl` way; returns how many."""
    if impl == "ours":
        return fp8.convert_frozen_linears(model, family.transformer_family(model).fp8_kind,
                                          keep_transposed=keep_transposed, fast_accum=fast_accum)
    if keep_transposed or fast_accum:
        raise ValueError(f"--fp8_transposed and --fp8_fast_accum are train/model/fp8.py's; --fp8_impl {impl} has "
                         "neither")
    if impl == "torchao_training":
        return convert_torchao_training(model)
    if impl == "torchao_inference":
        return convert_torchao_inference(model)
    raise ValueError(f"--fp8_impl {impl!r}: choose one of {', '.join(IMPLS)}")


def _check_frozen(model: torch.nn.Module, names: list[str]) -> None:
    if any(model.get_submodule(n).weight.requires_grad for n in names):
        raise ValueError("fp8 base weights need a frozen base (train.mode = 'lora')")


def convert_torchao_training(model: torch.nn.Module) -> int:
    """torchao Float8Linear (rowwise recipe) in place of the token linears."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    token = set(frozen_linears(model, "token"))
    _check_frozen(model, sorted(token))
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in token,
                               config=Float8LinearConfig.from_recipe_name("rowwise"))
    return len(token)


def convert_torchao_inference(model: torch.nn.Module) -> int:
    """torchao's fp8 weight tensors: dynamic rowwise fp8 activations on the token linears, weight-only on the
    modulation linears."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    token, vector = set(frozen_linears(model, "token")), set(frozen_linears(model, "vector"))
    _check_frozen(model, sorted(token | vector))
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda module, fqn: fqn in token)
    quantize_(model, Float8WeightOnlyConfig(), filter_fn=lambda module, fqn: fqn in vector)
    return len(token) + len(vector)
