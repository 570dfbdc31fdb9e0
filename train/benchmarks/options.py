"""train.bench's options (the training-step benchmark; `python -m train.bench --help` lists them) and the
combinations it refuses before anything is built."""

from __future__ import annotations

import argparse

from train.benchmarks import fp8_impls, peer
from train.benchmarks.flops import PEAK_TFLOPS
from train.benchmarks.workload import VARIANTS, bench_family
from train.config import TrainConfig
from train.runtime import steptime

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; area and text tokens default per model (1024^2 / 256 full, 128^2 / 32 tiny)."""
    p = argparse.ArgumentParser(description="Benchmark the project's DeepSpeed training step (encoders excluded)")
    for add in (
        _add_workload_arguments,
        _add_training_arguments,
        _add_fp8_arguments,
        _add_variant_arguments,
        _add_probe_arguments,
        _add_run_arguments,
    ):
        add(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    args.area = args.area or (128 * 128 if args.tiny else 1024 * 1024)
    args.text_tokens = args.text_tokens or (32 if args.tiny else 256)
    return args


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The model's size and the shapes of one micro-batch."""
    p.add_argument(
        "--variant",
        choices=VARIANTS,
        default="edit",
        help="the transformer measured: edit, the Qwen-Image MMDiT (20 B, 60 blocks; 2511's with --zero_cond_t), or "
        "qwen_image_21, Qwen-Image-2.1's single-stream DiT (7 B, 32 blocks; --refs 0 is text-to-image)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke: tiny transformer of train.make_tiny, fp32")
    p.add_argument("--num_layers", type=int, help="depth of the full architecture (default: the released one)")
    p.add_argument("--area", type=int, help="target pixel area (default 1024*1024; 128*128 with --tiny)")
    p.add_argument("--refs", type=int, default=1, help="reference images, each at --area (default 1)")
    p.add_argument("--text_tokens", type=int, help="prompt tokens (default 256; 32 with --tiny)")
    p.add_argument("--micro_batch", type=int, default=1, help="samples per GPU per step (default 1)")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """How the transformer trains: LoRA or full, checkpointing, compile, the 2511 variant."""
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--lora_rank", type=int, default=64)
    p.add_argument(
        "--lora_targets",
        choices=("attn", "default"),
        default="attn",
        help="attn: the 8 attention projections; default: the family's default targets (12)",
    )
    p.add_argument(
        "--checkpointing",
        choices=("none", "full"),
        default="none",
        help="full: recompute every transformer block in backward",
    )
    p.add_argument(
        "--checkpoint_blocks",
        type=int,
        default=0,
        help="with --checkpointing full: recompute only the first N blocks (default 0 = all)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument(
        "--compile_mode",
        choices=COMPILE_MODES,
        help="with --compile: torch.compile's mode for the blocks (default: torch's default); "
        "reduce-overhead replays each block as a CUDA graph",
    )
    p.add_argument(
        "--zero_cond_t",
        action="store_true",
        help="Qwen-Image-Edit-2511's transformer config: reference tokens modulated at timestep 0",
    )


def _add_variant_arguments(p: argparse.ArgumentParser) -> None:
    """The peer, and the levers of the project's step measured against their alternative."""
    p.add_argument(
        "--peer",
        choices=("diffsynth",),
        help="also time DiffSynth-Studio's DiT of the variant on the same workload, driven as its trainer drives it "
        "(train/benchmarks/peer.py, peer21.py; needs the bench extra), before the project's step",
    )
    p.add_argument(
        "--peer_variants",
        default=",".join(peer.DEFAULT_VARIANTS),
        help="comma-separated BASE:MODE[:ATTENTION], BASE bf16 or a DiffSynth quantisation method, MODE eager, "
        "compile or compile_dynamic, ATTENTION (2.1's peer) DiffSynth's attention implementation, e.g. torch or "
        f"flash_attention_4 (default: the one it picks; variants {','.join(peer.DEFAULT_VARIANTS)})",
    )
    p.add_argument(
        "--complex_rope",
        action="store_true",
        help="the project's step with diffusers' complex rotary embedding instead of real pairs "
        "(train/model/qwen_image/rope.py, qwen_image21/rope.py), to measure that lever",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "flex", "sdpa", "segmented"),
        default="auto",
        help="Qwen-Image-2.1's attention processor, as train.attention (train/model/qwen_image21/attention.py); "
        "the MMDiT ignores it",
    )
    p.add_argument(
        "--attention_kernel",
        choices=("sdpa", "fa4"),
        default="sdpa",
        help="the fused kernel of the attention (train/model/kept_attention.py use_kernel): sdpa, the one torch's "
        "SDPA picks; fa4, FlashAttention-4 (train/model/flash4.py), for 2.1's segmented op and every MMDiT block "
        "(routed through kept attention's op)",
    )
    p.add_argument(
        "--text_mask", action="store_true", help="pass an all-ones text mask (the pipelines pass none at micro-batch 1)"
    )
    p.add_argument(
        "--zero_stage",
        type=int,
        choices=(0, 1, 2),
        default=2,
        help="zero_optimization.stage of the engine (default 2, as ds_configs/zero2.json)",
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """How long each loop is timed, the baseline, the MFU peak and where the record goes."""
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument(
        "--warmup",
        type=int,
        default=steptime.WARMUP_STEPS,
        help=f"untimed steps first (default {steptime.WARMUP_STEPS}, as the trainer's step-time summary)",
    )
    p.add_argument(
        "--gc_every_steps",
        type=int,
        default=TrainConfig().gc_every_steps,
        help="the garbage collector as train.gc_every_steps runs it in training, for every timed loop "
        f"(default {TrainConfig().gc_every_steps}; 0 = Python's automatic collection)",
    )
    p.add_argument("--baseline", action="store_true", help="also time a plain PyTorch LoRA loop, print the ratio")
    p.add_argument(
        "--loss_tolerance",
        type=float,
        default=1e-3,
        help="with --baseline: largest relative loss difference per step accepted between the two "
        "loops' curves (default 1e-3)",
    )
    p.add_argument("--peak_tflops", type=float, default=PEAK_TFLOPS, help="peak per GPU for MFU (default 989)")
    p.add_argument("--json", help="append the result as one JSON line to this file (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")


def _add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """What else is read from the timed step: its profile and its kernels' floor."""
    p.add_argument("--profile", help="also profile 3 steps of each loop (torch.profiler); tables go to PROFILE.*.txt")
    p.add_argument(
        "--floor",
        action="store_true",
        help="after the step, time its attention and matmul kernels alone at its shapes and report the "
        "step's time over their sum (train/benchmarks/floor.py)",
    )
    p.add_argument(
        "--floor_repeats", type=int, default=20, help="with --floor: timed calls of each kernel (default 20)"
    )


def _add_fp8_arguments(p: argparse.ArgumentParser) -> None:
    """The fp8 base's options: train.fp8_base, fp8_transposed, and the other implementations."""
    p.add_argument(
        "--fp8_base",
        action="store_true",
        help="the project's step with the frozen block weights in fp8 (train.fp8_base; the baseline "
        "stays bf16, so --baseline compares the curves)",
    )
    p.add_argument(
        "--fp8_transposed",
        action="store_true",
        help="with --fp8_base: keep the fp8 weights transposed for the backward too (train.fp8_transposed)",
    )
    p.add_argument(
        "--fp8_fast_accum",
        action="store_true",
        help="with --fp8_base: the fp8 matmuls accumulate fast (train.fp8_fast_accum)",
    )
    p.add_argument(
        "--fp8_impl",
        choices=fp8_impls.IMPLS,
        default="ours",
        help="with --fp8_base: train/model/fp8.py (ours, default) or torchao's float8 training linear "
        "(torchao_training) or fp8 inference linears (torchao_inference); "
        "train/benchmarks/fp8_impls.py says what each does",
    )
    p.add_argument(
        "--fused_swiglu",
        action="store_true",
        help="with --fp8_base (ours): the SwiGLU MLP's input side in one autograd function whose backward is one "
        "Triton kernel on CUDA (train/model/swiglu.py), in place of inductor's fusion; Qwen-Image-2.1",
    )
    p.add_argument(
        "--ab_rounds",
        type=int,
        default=0,
        help="N rounds without the lever of --ab_lever and N with it, alternating on the same model and engine, "
        "each round --warmup + --steps steps; the difference measured in one process (train/benchmarks/ab.py)",
    )
    p.add_argument(
        "--ab_lever",
        choices=("fused_swiglu", "text_calls", "lean_step", "fa4_into"),
        default="fused_swiglu",
        help="with --ab_rounds: fused_swiglu (with --fused_swiglu), text_calls (with --attention_kernel fa4 and "
        "--attention segmented: a later 2.1 text run as one FlashAttention-4 call instead of two merged ones), "
        "fa4_into (the same settings: FlashAttention-4 writing the segmented op's outputs in place instead of copies) "
        "or lean_step (the ZeRO step's host work of train/runtime/ds_patches.py against DeepSpeed's own)",
    )


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject combinations the benchmark cannot run (parser.error exits with status 2)."""
    if (
        args.steps < 1
        or args.warmup < 0
        or args.micro_batch < 1
        or args.refs < 0
        or args.lora_rank < 1
        or args.gc_every_steps < 0
    ):
        parser.error("--steps, --micro_batch, --lora_rank must be >= 1; --warmup, --refs and --gc_every_steps >= 0")
    if args.area is not None and args.area < 32 * 32:
        parser.error("--area must be at least 1024 px (one 32x32 tile)")
    if args.text_tokens is not None and args.text_tokens < 1:
        parser.error("--text_tokens must be >= 1")
    if args.tiny and args.num_layers is not None:
        parser.error("--num_layers applies to the full architecture, not --tiny")
    if args.num_layers is not None and args.num_layers < 1:
        parser.error("--num_layers must be >= 1")
    if args.fp8_base and args.mode != "lora":
        parser.error("--fp8_base needs --mode lora (a frozen base)")
    if args.fp8_transposed and not args.fp8_base:
        parser.error("--fp8_transposed applies with --fp8_base")
    if args.fp8_fast_accum and not args.fp8_base:
        parser.error("--fp8_fast_accum applies with --fp8_base")
    if args.compile_mode and not args.compile:
        parser.error("--compile_mode applies with --compile")
    if args.floor and (args.mode != "lora" or args.fp8_impl != "ours" or args.floor_repeats < 1):
        parser.error(
            "--floor times a frozen base's matmuls as train/model/fp8.py makes them: use it with --mode lora "
            "(and --fp8_impl ours), --floor_repeats >= 1"
        )
    if args.baseline and args.mode != "lora":
        parser.error("--baseline is the plain PyTorch LoRA loop; use it with --mode lora")
    if args.baseline and args.attention_kernel != "sdpa":
        parser.error("--baseline runs SDPA as the plain loop would; drop --attention_kernel or --baseline")
    if args.fp8_impl != "ours" and not args.fp8_base:
        parser.error("--fp8_impl applies with --fp8_base")
    if args.ab_rounds:
        _check_ab(parser, args)
    if args.fused_swiglu and (not args.fp8_base or args.fp8_impl != "ours"):
        parser.error("--fused_swiglu fuses train/model/fp8.py's base matmuls: use it with --fp8_base (--fp8_impl ours)")
    if (args.fp8_transposed or args.fp8_fast_accum) and args.fp8_impl != "ours":
        parser.error("--fp8_transposed and --fp8_fast_accum are train/model/fp8.py's; use them with --fp8_impl ours")
    _check_variant(parser, args)
    if args.peer:
        if args.mode != "lora" or args.micro_batch != 1 or args.checkpoint_blocks:
            parser.error(
                "--peer trains LoRA at micro-batch 1, every block checkpointed or none (as its trainer); "
                "drop --mode full, --micro_batch and --checkpoint_blocks"
            )
        try:
            variants = peer.parse_variants(args.peer_variants)
        except ValueError as e:
            parser.error(str(e))
        if args.variant == "edit" and any(v.attention for v in variants):
            parser.error("--peer_variants: an attention implementation (BASE:MODE:ATTENTION) is for Qwen-Image-2.1's "
                         "peer; the MMDiT's DiffSynth DiT calls FlashAttention-3 where installed, else SDPA")


def _check_ab(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--ab_rounds: a count, no profiler, and the setting its lever switches."""
    if args.profile or args.ab_rounds < 1:
        parser.error("--ab_rounds takes a count >= 1 and no --profile")
    if args.ab_lever == "fused_swiglu" and not args.fused_swiglu:
        parser.error("--ab_rounds alternates --fused_swiglu off and on: give it with --fused_swiglu")
    if args.ab_lever in ("text_calls", "fa4_into") and (
        args.attention_kernel != "fa4" or args.attention != "segmented" or args.variant != "qwen_image_21"
    ):
        parser.error(f"--ab_lever {args.ab_lever} is 2.1's segmented op on FlashAttention-4: give --variant "
                     "qwen_image_21 --attention segmented --attention_kernel fa4")


def _check_variant(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What only one family has: 2511's modulation and the MMDiT's probes; the family's limits on references and on
    the text tokens around them."""
    fam = bench_family(args.variant)
    most = max(v.max_references for v in fam.variants)
    if args.refs > most:
        parser.error(f"--refs {args.refs}: {fam.title} takes at most {most} references")
    if args.fused_swiglu and fam.swiglu is None:
        parser.error(f"--fused_swiglu: {fam.title}'s blocks have no SwiGLU MLP; drop it for --variant {args.variant}")
    if args.variant == "edit":
        return
    if args.zero_cond_t or args.floor:
        parser.error(f"--zero_cond_t and --floor are the Qwen-Image MMDiT's; drop them for --variant {args.variant}")
    fewest = fam.bench.min_text_tokens(args.refs)
    if args.text_tokens is not None and args.text_tokens < fewest:
        parser.error(
            f"--text_tokens must be at least {fewest} with --refs {args.refs} (the text around the image slots)"
        )
