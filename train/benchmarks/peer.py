"""The peer in the benchmark: DiffSynth-Studio's `QwenImageDiT`, trained as DiffSynth's trainer trains an edit LoRA.

The peer's code comes from the installed `diffsynth` package (the optional `bench` extra, pinned in setup.cfg);
nothing of it is copied here. Its top-level `import diffsynth` runs every submodule (it needs imageio, modelscope,
...), so `load` registers the package's folders under `_diffsynth_peer` without running their `__init__` files
and imports only the files the step needs; their relative imports resolve inside the installed package.

One training step, as DiffSynth 2.1.12 runs it (each item names the file of the installed package it follows):

- model (`models/qwen_image_dit.py`): `QwenImageDiT(num_layers)`, the Qwen-Image architecture; built here at
  random init in bf16 (its loader builds it in the pipeline dtype, bf16, then loads the weights).
- frozen base (`diffusion/base_pipeline.py` freeze_except): every weight frozen, the module in eval mode.
- quantised base (`--quant_options dit:<method>`, `core/quant`): at load, before LoRA, `QuantizeConfig(method)`
  replaces every nn.Linear of the DiT by its backend's quantised linear. The trainer accepts only methods whose
  backend says `is_differentiable`: torchao's weight-only configs (int8 / fp8 / nvfp4 weight, dequantised for a
  bf16 matmul) and comfy-kitchen's W8A8 (not installable here; its backend also says not compileable).
- LoRA (`diffusion/training_module.py` add_lora_to_model): peft `inject_adapter_in_model` with
  `LoraConfig(r, lora_alpha=r, target_modules)`, then the trainable LoRA weights cast to the pipeline dtype (bf16).
- loss (`diffusion/loss.py` FlowMatchSFTLoss with `diffusion/flow_match.py`'s "Qwen-Image" schedule of 1000
  training timesteps): a timestep index drawn on the host, x_t = (1 - sigma) x0 + sigma e through the scheduler's
  `add_noise` (which moves the timestep to the host: a synchronisation per step), target e - x0, MSE in fp32 on the
  target latents times the scheduler's `training_weight`.
- forward (`pipelines/qwen_image.py` model_fn_qwen_image, the edit path; that file imports imageio, so `forward`
  below makes the same calls in the same order): target and each reference (`edit_latents`) packed 2x2 and
  concatenated along the sequence, `img_shapes` one entry per image, timestep / 1000, `time_text_embed`,
  `txt_in(txt_norm(prompt))`, rotary embedding from `img_shapes` and the text lengths of the prompt mask, every
  block through `core/gradient`'s gradient_checkpoint_forward, `norm_out`, `proj_out`, the target tokens kept.
  Qwen-Image-Edit-2511 (`zero_cond_t`) doubles the timestep batch with t = 0 and passes a modulation index.
- optimizer (`diffusion/runner.py` launch_training_task): `torch.optim.AdamW(lr, weight_decay=0.01)` over the
  trainable parameters; backward, step, the ConstantLR step (nothing to compute), zero_grad; micro-batch 1.
- compile: the trainer compiles nothing. Its pipeline's `compile_pipeline` (the inference API) compiles each
  `QwenImageTransformerBlock` in place (regional compilation, `dynamic=True` by default). The benchmark offers
  that (`compile_dynamic`), torch.compile's defaults on the same blocks (`compile`, as the project compiles its
  blocks), and no compilation (`eager`, what the trainer runs).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

PACKAGE = "_diffsynth_peer"  # the name the installed package's files are registered under (see `load`)
TESTED_VERSION = "2.1.12"  # the version this driver was written against (setup.cfg's bench extra pins it)
MODES = ("eager", "compile", "compile_dynamic")
# DiffSynth's attention implementations (core/attention/attention.py), which its 2.1 DiT's unmasked calls go through
ATTENTIONS = ("torch", "flash_attention_4", "flash_attention_3", "flash_attention_2", "sage_attention", "xformers")
DEFAULT_VARIANTS = ("bf16:compile", "bf16:compile_dynamic", "bf16:eager", "torchao_fp8_w8a16:compile",
                    "torchao_int8_w8a16:compile")
TRAIN_TIMESTEPS = 1000
LR, WEIGHT_DECAY = 1e-4, 0.01  # the shell scripts' --learning_rate 1e-4; the parser's --weight_decay default
LATENT_CHANNELS = 16  # the VAE's latent channels; the DiT packs 2x2 of them into 64


class PeerUnavailable(RuntimeError):
    """The bench extra is not installed (exit_with prints the message without a traceback)."""

    without_traceback = True


def package_dir() -> Path:
    """Folder of the installed `diffsynth` package (found without importing it)."""
    spec = importlib.util.find_spec("diffsynth")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("--peer diffsynth needs the bench extra: pip install -e '.[bench]' (or, without its "
                              "many dependencies: pip install --no-deps diffsynth==2.1.12 einops torchao==0.18.0)")
    return Path(spec.submodule_search_locations[0])


def version() -> str:
    return importlib.metadata.version("diffsynth")


def not_measured() -> str:
    """What the rows leave out: DiffSynth's fp8-compute training method, whose backend (comfy-kitchen) does not
    install from PyPI, unless it is installed (then a `comfy_kitchen_fp8_w8a8:eager` variant measures it)."""
    if importlib.util.find_spec("comfy_kitchen") is not None:
        return "comfy_kitchen_fp8_w8a8: comfy-kitchen is installed; add comfy_kitchen_fp8_w8a8:eager to --peer_variants"
    return ("comfy_kitchen_fp8_w8a8 (fp8 forward, dequantised backward, not compileable): comfy-kitchen is not "
            "installed (not installable from PyPI)")


def load(name: str) -> types.ModuleType:
    """`diffsynth.<name>` (e.g. "models.qwen_image_dit") from the installed package, without running the
    `__init__` of the package or of its parent folders (they import the whole library)."""
    root = package_dir()
    parts = name.split(".")
    for depth in range(len(parts)):
        parent = ".".join([PACKAGE, *parts[:depth]])
        if parent not in sys.modules:
            stub = types.ModuleType(parent)
            stub.__path__ = [str(root.joinpath(*parts[:depth]))]  # a namespace for the import system to search
            sys.modules[parent] = stub
    return importlib.import_module(f"{PACKAGE}.{name}")


# ---------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One peer configuration: its base ("bf16" or a DiffSynth quantisation method), how blocks run, and (2.1 only)
    DiffSynth's attention implementation, "" for the one it picks itself from what is installed."""

    base: str
    mode: str
    attention: str = ""

    @property
    def name(self) -> str:
        return ":".join(part for part in (self.base, self.mode, self.attention) if part)


def parse_variants(text: str) -> list[Variant]:
    """'bf16:compile,torchao_fp8_w8a16:eager,bf16:compile:torch' -> variants; ValueError naming the bad entry and
    the choices."""
    variants = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        base, mode, attention, *rest = entry.split(":") + ["", ""]
        if mode not in MODES or not base or (attention and attention not in ATTENTIONS) or any(rest):
            raise ValueError(f"--peer_variants entry {entry!r}: write BASE:MODE[:ATTENTION] with BASE bf16 or a "
                             f"DiffSynth quantisation method (e.g. torchao_fp8_w8a16), MODE one of {', '.join(MODES)} "
                             f"and ATTENTION (Qwen-Image-2.1's peer) one of {', '.join(ATTENTIONS)}")
        variants.append(Variant(base, mode, attention))
    if not variants:
        raise ValueError("--peer_variants is empty; e.g. bf16:compile,bf16:eager")
    return variants


# ---------------------------------------------------------------- model


@dataclass(frozen=True)
class Dims:
    """Sizes of the DiT; the defaults are Qwen-Image's (QwenImageDiT hard-codes them)."""

    width: int = 3072
    heads: int = 24
    joint_dim: int = 3584
    axes: tuple[int, int, int] = (16, 56, 56)


FULL = Dims()
TINY = Dims(width=64, heads=4, joint_dim=32, axes=(8, 4, 4))  # the sizes of train.make_tiny's transformer


def build_dit(num_layers: int, device: torch.device | str, dtype: torch.dtype, dims: Dims = FULL) -> torch.nn.Module:
    """The peer's QwenImageDiT at random init, created on `device` in `dtype`. QwenImageDiT fixes Qwen-Image's
    sizes; for smaller `dims` (tests) the same class is assembled from its own modules at those sizes."""
    dit_module = load("models.qwen_image_dit")
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights created in `dtype` directly: no fp32 copy of 20 B parameters
    try:
        if dims == FULL:
            with torch.device(device):
                return dit_module.QwenImageDiT(num_layers=num_layers)
        with torch.device("meta"):
            dit = dit_module.QwenImageDiT(num_layers=0)  # the container; every part is replaced below
        with torch.device(device):
            _assemble_small(dit, dit_module, num_layers, dims)
        return dit
    finally:
        torch.set_default_dtype(saved)


def _assemble_small(dit: torch.nn.Module, m: types.ModuleType, num_layers: int, d: Dims) -> None:
    """Replace every part of `dit` by the peer's own module classes at the sizes `d` (what QwenImageDiT.__init__
    builds, with its constants 3072 / 24 / 3584 / (16, 56, 56) replaced)."""
    general = load("models.general_modules")
    dit.pos_embed = m.QwenEmbedRope(theta=10000, axes_dim=list(d.axes), scale_rope=True)
    dit.time_text_embed = general.TimestepEmbeddings(256, d.width, diffusers_compatible_format=True, scale=1000,
                                                     align_dtype_to_timestep=False)
    dit.txt_norm = general.RMSNorm(d.joint_dim, eps=1e-6)
    dit.img_in = torch.nn.Linear(4 * LATENT_CHANNELS, d.width)
    dit.txt_in = torch.nn.Linear(d.joint_dim, d.width)
    dit.transformer_blocks = torch.nn.ModuleList(
        m.QwenImageTransformerBlock(dim=d.width, num_attention_heads=d.heads, attention_head_dim=d.width // d.heads)
        for _ in range(num_layers))
    dit.norm_out = general.AdaLayerNorm(d.width, single=True)
    dit.proj_out = torch.nn.Linear(d.width, 4 * LATENT_CHANNELS)


def quantize_base(dit: torch.nn.Module, method: str) -> dict:
    """The peer's own quantisation of every nn.Linear (its --quant_options dit:<method>); returns the backend's
    capabilities. ValueError for a method its trainer refuses (not differentiable)."""
    quant = load("core.quant")
    config = quant.QuantizeConfig(method=method)
    capabilities = config.backend.capabilities()
    if not capabilities.get("is_differentiable", True):
        raise ValueError(f"peer variant {method!r}: DiffSynth's trainer refuses it (its backend is not "
                         "differentiable); use a weight-only method such as torchao_fp8_w8a16")
    config.quantize_model(dit)
    return capabilities


def add_lora(dit: torch.nn.Module, targets: list[str], rank: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Freeze the DiT, inject peft LoRA (alpha = rank) into `targets` and cast the LoRA weights to `dtype`, as
    DiffSynth's training module does; returns the trainable parameters."""
    from peft import LoraConfig, inject_adapter_in_model

    dit.eval()
    dit.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)), dit)
    params = [p for p in dit.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.to(dtype)
    return params


def compile_blocks(dit: torch.nn.Module, mode: str) -> None:
    """Regional compilation of the peer's blocks: `compile_dynamic` as its compile_pipeline (dynamic=True),
    `compile` with torch.compile's defaults (as the project's blocks)."""
    if mode == "eager":
        return
    for block in dit.transformer_blocks:
        block.compile(dynamic=True) if mode == "compile_dynamic" else block.compile()


# ---------------------------------------------------------------- forward and loss


@dataclass
class Inputs:
    """One edit sample in the peer's layout: latents (B=1, 16, h, w) at the VAE's resolution."""

    target: torch.Tensor
    references: list[torch.Tensor]
    prompt_emb: torch.Tensor  # (1, text tokens, joint_dim)
    prompt_mask: torch.Tensor  # (1, text tokens), all ones: the pipeline's mask for an unpadded prompt


def make_inputs(latent_hw: tuple[int, int], refs: int, text_tokens: int, joint_dim: int, device: torch.device,
                dtype: torch.dtype, seed: int) -> Inputs:
    """Random latents and prompt embeddings of the workload's shapes (references at the target's size)."""
    g = torch.Generator(device).manual_seed(seed)
    h, w = latent_hw
    latents = [torch.randn(1, LATENT_CHANNELS, h, w, generator=g, device=device).to(dtype) for _ in range(1 + refs)]
    prompt = torch.randn(1, text_tokens, joint_dim, generator=g, device=device).to(dtype)
    mask = torch.ones(1, text_tokens, dtype=torch.long, device=device)
    return Inputs(latents[0], latents[1:], prompt, mask)


def _pack(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4): 2x2 patches as tokens, channel-major inside a patch."""
    from einops import rearrange

    return rearrange(latents_BCHW, "b c (h p) (w q) -> b (h w) (c p q)", p=2, q=2)


def _unpack(tokens_BLD: torch.Tensor, h: int, w: int) -> torch.Tensor:
    from einops import rearrange

    return rearrange(tokens_BLD, "b (h w) (c p q) -> b c (h p) (w q)", h=h // 2, w=w // 2, p=2, q=2)


def forward(dit: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, x: Inputs, zero_cond_t: bool,
            checkpointing: bool) -> torch.Tensor:
    """The noise prediction for the target latents: the calls of model_fn_qwen_image for an edit sample."""
    gradient = load("core.gradient")
    h, w = latents.shape[2:]
    images = [latents, *x.references]
    img_shapes = [(1, im.shape[2] // 2, im.shape[3] // 2) for im in images]
    target_tokens = img_shapes[0][1] * img_shapes[0][2]
    txt_seq_lens = x.prompt_mask.sum(dim=1).tolist()  # a host sync, as in the peer
    t = timestep / TRAIN_TIMESTEPS
    image = dit.img_in(torch.cat([_pack(im) for im in images], dim=1))
    modulate_index = None
    if zero_cond_t:  # 2511: references modulated at t = 0
        t = torch.cat([t, t * 0], dim=0)
        modulate_index = torch.tensor([[0] * target_tokens + [1] * (image.shape[1] - target_tokens)],
                                      device=t.device, dtype=torch.int)
    conditioning = dit.time_text_embed(t, image.dtype)
    text = dit.txt_in(dit.txt_norm(x.prompt_emb))
    rotary = dit.pos_embed(img_shapes, txt_seq_lens, device=latents.device)
    for block in dit.transformer_blocks:
        text, image = gradient.gradient_checkpoint_forward(
            block, checkpointing, False, image=image, text=text, temb=conditioning, image_rotary_emb=rotary,
            attention_mask=None, enable_fp8_attention=False, modulate_index=modulate_index, kv_cache=None)
    if zero_cond_t:
        conditioning = conditioning.chunk(2, dim=0)[0]
    image = dit.proj_out(dit.norm_out(image, conditioning))[:, :target_tokens]
    return _unpack(image, h, w)


class FlowMatchLoss:
    """FlowMatchSFTLoss over the peer's own scheduler ("Qwen-Image", 1000 training timesteps)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        scheduler = load("diffusion.flow_match").FlowMatchScheduler("Qwen-Image")
        scheduler.set_timesteps(TRAIN_TIMESTEPS, training=True)
        self.scheduler, self.device, self.dtype = scheduler, device, dtype

    def __call__(self, x0: torch.Tensor, predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The loss of clean latents `x0`; predict(noisy latents, timestep in [0, 1000)) is the model's call."""
        s = self.scheduler
        index = torch.randint(0, len(s.timesteps), (1,))  # on the host, from torch's global generator
        timestep = s.timesteps[index].to(dtype=self.dtype, device=self.device)
        noise = torch.randn_like(x0)
        noisy = s.add_noise(x0, noise, timestep)
        target = s.training_target(x0, noise, timestep)
        prediction = predict(noisy, timestep)
        loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
        return loss * s.training_weight(timestep)


# ---------------------------------------------------------------- the step


@dataclass
class Setup:
    """A peer ready to train: its step (step index -> detached loss) and what the report needs."""

    step: Callable[[int], torch.Tensor]
    model: torch.nn.Module
    trainable_params: int
    total_params: int
    quantized: dict = field(default_factory=dict)  # backend capabilities, empty for bf16
    attention: str = ""  # DiffSynth's attention implementation the step ran with, where the driver sets one


def build(variant: Variant, num_layers: int, latent_hw: tuple[int, int], refs: int, text_tokens: int,
          targets: list[str], rank: int, device: torch.device, dtype: torch.dtype, seed: int,
          zero_cond_t: bool = False, checkpointing: bool = False, dims: Dims = FULL) -> Setup:
    """The peer's DiT (quantised if the variant says so), LoRA, compiled blocks, AdamW, and its step."""
    torch.manual_seed(seed)
    dit = build_dit(num_layers, device, dtype, dims)
    loss_fn = FlowMatchLoss(device, dtype)
    x = make_inputs(latent_hw, refs, text_tokens, dims.joint_dim, device, dtype, seed)

    def loss() -> torch.Tensor:
        return loss_fn(x.target, lambda noisy, t: forward(dit, noisy, t, x, zero_cond_t, checkpointing))

    return trainer(dit, variant, targets, rank, dtype, loss)


def trainer(dit: torch.nn.Module, variant: Variant, targets: list[str], rank: int, dtype: torch.dtype,
            loss: Callable[[], torch.Tensor]) -> Setup:
    """DiffSynth's trainer around `dit`: the base quantised if the variant says so, LoRA, compiled blocks, AdamW;
    each step computes `loss()`, backward, optimizer step, zero_grad."""
    capabilities = {}
    if variant.base != "bf16":
        capabilities = quantize_base(dit, variant.base)
        if variant.mode != "eager" and not capabilities.get("is_compileable", True):
            raise ValueError(f"peer variant {variant.name!r}: its backend is not compileable; use :eager")
    params = add_lora(dit, targets, rank, dtype)
    compile_blocks(dit, variant.mode)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def step(i: int) -> torch.Tensor:
        value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        return value.detach()

    total = sum(p.numel() for p in dit.parameters())
    return Setup(step, dit, sum(p.numel() for p in params), total, capabilities)


def run_variants(variants: list[Variant], time_step: Callable[[Callable[[int], torch.Tensor]], dict],
                 free: Callable[[], None], builder: Callable[..., Setup] | None = None, **build_kwargs) -> list[dict]:
    """Build (with `builder`, default `build`; peer21.build for Qwen-Image-2.1) and time each variant in turn
    (time_step: step -> timing fields); a variant that fails (not installed, out of memory, refused) gives a row
    with its error instead of stopping the others."""
    rows = []
    for variant in variants:
        row = {"variant": variant.name}
        try:
            setup = (builder or build)(variant, **build_kwargs)
            row.update(trainable_params=setup.trainable_params, total_params=setup.total_params,
                       **({"attention": setup.attention} if setup.attention else {}), **time_step(setup.step))
        except (ImportError, ValueError, TypeError, RuntimeError, NotImplementedError, AssertionError) as e:
            # RuntimeError covers CUDA out of memory and inductor failures; the row says what happened
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        finally:
            setup = None
            free()
        rows.append(row)
    return rows
