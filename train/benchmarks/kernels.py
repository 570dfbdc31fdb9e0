"""The step's kernels by device time, each with its category, for `python -m train.bench --profile P` on a GPU.

The category says which part of the floor a kernel belongs to (train/benchmarks/floor.py: attention, fp8 and dense
matmuls) or what it is beyond it. A kernel is placed by its own name where that says enough (communication, copies
and fills), otherwise by the op that launched it (the nearest `aten::` ancestor in the profiler's tree: _scaled_mm
is an fp8 matmul, mm / addmm / bmm a dense one, the scaled-dot-product and flash / cuDNN attention ops attention),
and otherwise by its name again (inductor's Triton kernels, eager elementwise kernels). With compiled blocks,
inductor calls the matmul and attention ops as extern kernels, so they keep their aten parents.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (category, pattern on the kernel's name), tried before the launching op
BY_KERNEL = (
    ("communication", re.compile(r"nccl|allreduce|all_reduce|reduce_scatter|allgather", re.I)),
    ("copies and fills", re.compile(r"^Memcpy|^Memset|memcpy|memset", re.I)),
)
# (category, pattern on the launching aten op's name)
BY_OP = (
    ("fp8 matmul", re.compile(r"^aten::_scaled_mm")),
    ("attention", re.compile(r"^aten::_?(scaled_dot_product|flash_attention|efficient_attention|cudnn_attention)")),
    ("dense matmul", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$")),
)
# (category, pattern on the kernel's name), tried last
BY_NAME = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention", re.I)),
    ("inductor fused", re.compile(r"^triton_")),
    ("elementwise (eager)", re.compile(r"elementwise|vectorized|reduce_kernel|unrolled", re.I)),
)


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: its name, the aten op that launched it ("" = none found) and its device time (us)."""

    name: str
    op: str
    us: float


def category(k: Kernel) -> str:
    """Where `k` belongs (see the module docstring); "other" when nothing matches."""
    for name, pattern in BY_KERNEL:
        if pattern.search(k.name):
            return name
    for name, pattern in BY_OP:
        if pattern.search(k.op):
            return name
    for name, pattern in BY_NAME:
        if pattern.search(k.name):
            return name
    return "other"


def launching_op(event) -> str:
    """The nearest `aten::` op at or above a profiler event in its CPU tree ("" when there is none)."""
    while event is not None:
        if event.name.startswith("aten::"):
            return event.name
        event = event.cpu_parent
    return ""


def profiled_kernels(prof) -> list[Kernel]:
    """Every kernel of a finished torch.profiler run, attached to the op that launched it."""
    return [Kernel(k.name, launching_op(e), k.duration) for e in prof.events() for k in e.kernels]


def report(kernels: list[Kernel], steps: int, top: int = 30) -> str:
    """Kernel time per step by category, then the `top` kernels (by name and launching op) by time per step."""
    total = sum(k.us for k in kernels)
    if not total:
        return "kernels: none recorded (no device)\n"
    by_category: dict[str, float] = {}
    by_kernel: dict[tuple[str, str, str], list[float]] = {}
    for k in kernels:
        cat = category(k)
        by_category[cat] = by_category.get(cat, 0.0) + k.us
        by_kernel.setdefault((cat, k.op, k.name), []).append(k.us)
    lines = [f"kernels: {total / steps / 1e3:.2f} ms of device time per step, by category:"]
    for cat, us in sorted(by_category.items(), key=lambda x: -x[1]):
        lines.append(f"  {cat:22s} {us / steps / 1e3:9.2f} ms/step {100 * us / total:5.1f}%")
    lines.append(f"top {top} kernels (ms/step, calls/step, share, category, launching op, kernel):")
    ranked = sorted(by_kernel.items(), key=lambda x: -sum(x[1]))[:top]
    for (cat, op, name), times in ranked:
        lines.append(
            f"  {sum(times) / steps / 1e3:8.3f} {len(times) / steps:7.1f} {100 * sum(times) / total:5.1f}%  "
            f"{cat:20s} {op or '-':32s} {name[:100]}"
        )
    return "\n".join(lines) + "\n"
