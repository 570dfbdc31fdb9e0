"""One LoRA down-projection for the adapted linears of a compiled block that read the same input.

peft gives every adapted linear its own `lora_A`, so a block's q, k and v (and the SwiGLU MLP's gate and up
projections) each multiply the same activation by a small (rank x width) matrix. Those matmuls are memory-bound at
training shapes: the forward reads the activation once per projection, the backward reads it again once per
projection for the weight gradient and writes one input gradient per projection. One matmul against the stacked
matrices computes the same products (the stacked weight's rows are the projections' rows, so each output column is
the same dot product) and its backward reads the activation once and writes one input gradient.

`FuseLoraDown` is an inductor pre-grad pass (`torch._inductor.config.pre_grad_custom_pass`): it runs on the block's
captured graph before autograd is traced, so the forward and the backward both see the fused form. The adapter's
parameters stay as they are (peft's modules, its state dict, the exports): only the compiled computation changes.
It fuses the linear calls that peft's `lora_A` modules make (found by the module path each call node records), that
share one input node and have no bias. A LoRA with dropout gives each projection its own dropped input, so nothing
is fused there.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
DOWN_MODULE = ".lora_A."  # peft's down-projection modules: `<linear>.lora_A.<adapter>`


def is_lora_down(node: torch.fx.Node) -> bool:
    """A bias-free linear call made by a peft `lora_A` module (the innermost entry of the node's module stack)."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return False
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    stack = node.meta.get("nn_module_stack") or {}
    if bias is not None or not stack or len(node.args) < 2:
        return False
    path = str(list(stack.values())[-1][0])
    return DOWN_MODULE in path + "."


def shared_input_groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The LoRA down-projection calls grouped by the input node they read; groups of two or more, in graph order."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if is_lora_down(node) and isinstance(node.args[0], torch.fx.Node):
            groups[node.args[0]].append(node)
    return [calls for calls in groups.values() if len(calls) > 1]


def _example(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def fuse_group(graph: torch.fx.Graph, calls: list[torch.fx.Node]) -> bool:
    """Replace `calls` (linear(x, W_i)) by one linear(x, cat(W_i)) split along the last dimension. Returns False
    (and leaves the graph as it was) where a weight's row count is unknown or a weight is made after the first call."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(calls, key=order.__getitem__)
    weights = [call.args[1] for call in calls]
    examples = [_example(w) if isinstance(w, torch.fx.Node) else None for w in weights]
    if any(e is None for e in examples) or any(order[w] > order[first] for w in weights):
        return False
    rows = [int(e.shape[0]) for e in examples]
    with graph.inserting_before(first):
        stacked = graph.call_function(torch.cat, (weights, 0))
        fused = graph.call_function(torch._C._nn.linear, (first.args[0], stacked))
        parts = graph.call_function(torch.split, (fused, rows, -1))
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(calls))]
    # Without autograd: the pass runs inside the block's first call, where a checkpoint's saved-tensor hooks would
    # count whatever these fake products saved, and the recomputation would then save fewer.
    with torch.no_grad():
        stacked.meta["example_value"] = torch.cat(examples, 0)
        fused.meta.update(first.meta)
        fused.meta["example_value"] = torch.nn.functional.linear(_example(first.args[0]),
                                                                 stacked.meta["example_value"])
    for call, output in zip(calls, outputs, strict=True):
        output.meta.update(call.meta)
        call.replace_all_uses_with(output)
        graph.erase_node(call)
    return True


def fuse_lora_down(graph: torch.fx.Graph) -> int:
    """Fuse every group of LoRA down-projections that share an input; returns how many groups were fused."""
    return sum(fuse_group(graph, calls) for calls in shared_input_groups(graph))


class FuseLoraDown(CustomGraphPass):
    """fuse_lora_down as inductor's pre-grad custom pass (its uuid, this file's hash, keys inductor's caches)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_lora_down(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


PASS = FuseLoraDown()  # one instance: blocks compiled with equal options share their compiled graph


def compile_options(mode: str | None) -> dict:
    """torch.compile `options` for LoRA blocks: `mode`'s inductor settings (torch.compile takes a mode or options,
    not both) and the pass."""
    from torch._inductor import list_mode_options

    return {**(list_mode_options(mode) if mode else {}), "pre_grad_custom_pass": PASS}
