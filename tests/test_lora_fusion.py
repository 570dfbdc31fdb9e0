"""The compiled blocks' one LoRA down-projection per shared input (train/model/lora_fusion.py): which calls it fuses
in the captured graphs of both families' blocks, that the fused blocks train exactly as peft's layers do (loss and
every LoRA gradient, A included), what it leaves alone, and that prepare's compiled blocks run it under inductor."""

from __future__ import annotations

import peft
import pytest
import torch

from train.config import LoraConfig
from train.model import family, lora_fusion, prepare
from train.model.qwen_image21 import batches
from train.model.qwen_image21.tiny import build_transformer as build_21

FAM21 = family.family_named("qwen_image21")


def lora_21(**options):
    """The tiny 2.1 transformer (2 blocks) with LoRA (rank 4) on every linear, B drawn non-zero so that every A has a
    gradient."""
    torch.manual_seed(0)
    model = build_21(num_layers=2)
    lora = LoraConfig(rank=4, alpha=4.0, target_modules=list(FAM21.lora.targets))
    prepare.prepare_for_training(model, "lora", lora, **{"gradient_checkpointing": False, "compile_blocks": False,
                                                          **options})
    for i, (name, p) in enumerate(model.named_parameters()):
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(i))
    return model.train()


def loss_and_grads_21(model):
    b = batches.synthetic_batch(model, 2, (4, 4), [(4, 4), (2, 4)], 20, torch.device("cpu"), torch.float32)
    kwargs = FAM21.transformer_inputs(b, b.x0, torch.tensor([0.3, 0.8]), torch.float32)
    out = FAM21.target_prediction(model(**kwargs), b)
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def fusing_backend(record: list):
    """A torch.compile backend that runs the pass on each captured graph and then runs it eagerly; `record` gets
    (down-projection calls before, groups fused, calls after, row counts of the fused calls) per graph."""
    def backend(gm, example_inputs):
        before = sum(map(lora_fusion.is_lora_down, gm.graph.nodes))
        fused = lora_fusion.fuse_lora_down(gm.graph)
        gm.recompile()
        rows = sorted(int(n.meta["example_value"].shape[-1]) for n in gm.graph.nodes
                      if lora_fusion.is_lora_down(n) and n.args[1].target is torch.cat)
        record.append((before, fused, sum(map(lora_fusion.is_lora_down, gm.graph.nodes)), rows))
        return gm.forward
    return backend


def test_2_1_blocks_fuse_qkv_and_gate_up_and_train_exactly_as_peft():
    """A 2.1 block reads its q, k and v from one activation and its MLP's gate and up from another: 7 down-projections
    become 4 calls, two of them stacked (3 x rank and 2 x rank rows); loss and every gradient as peft's layers."""
    loss, grads = loss_and_grads_21(lora_21())
    model, record = lora_21(), []
    for block in model.transformer_blocks:
        block.compile(backend=fusing_backend(record))
    fused_loss, fused_grads = loss_and_grads_21(model)
    assert record and all(r == (7, 2, 4, [8, 12]) for r in record)
    assert torch.allclose(loss, fused_loss, rtol=1e-6)
    a_grads = [n for n in grads if "lora_A" in n]
    assert len(a_grads) == 14 and all(grads[n].abs().max() > 0 for n in a_grads)
    assert all(torch.allclose(grads[n], fused_grads[n], rtol=1e-5, atol=1e-7) for n in grads)


def test_mmdit_blocks_fuse_each_stream_s_qkv():
    """Qwen-Image's MMDiT block: the image stream's to_q/k/v and the text stream's add_q/k/v proj, two groups of 3;
    the output projections and the MLPs read other inputs and stay as they are."""
    from test_variants import _loss_and_lora_grads, build_transformer

    def lora_mmdit():
        torch.manual_seed(0)
        model = build_transformer(True)
        targets = FAM_MMDIT.lora.targets
        prepare.prepare_for_training(model, "lora", LoraConfig(rank=4, alpha=4.0, target_modules=list(targets)),
                                     gradient_checkpointing=False, compile_blocks=False, real_rope=False)
        for i, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(i))
        return model.train()

    FAM_MMDIT = family.family_named("qwen_image")
    ref_loss, ref_grads, scale = _loss_and_lora_grads(lora_mmdit())
    model, record = lora_mmdit(), []
    for block in model.transformer_blocks:
        block.compile(backend=fusing_backend(record))
    loss, grads, _ = _loss_and_lora_grads(model)
    calls = len(FAM_MMDIT.lora.targets)
    assert record and all(r[:3] == (calls, 2, calls - 4) and r[3] == [12, 12] for r in record)
    assert abs(loss - ref_loss) <= 1e-6 * scale
    assert (grads - ref_grads).abs().max().item() <= 1e-5 * ref_grads.abs().max().item()


class Projections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) * self.v(x)


@pytest.mark.parametrize("dropout, fused", [(0.0, 1), (0.1, 0)])
def test_only_down_projections_reading_one_node_are_fused(dropout, fused):
    """With LoRA dropout each projection reads its own dropped copy: nothing to fuse. The base layers (peft's
    base_layer, with a bias or not) are never touched."""
    model = peft.get_peft_model(Projections(), peft.LoraConfig(r=2, lora_dropout=dropout, target_modules=["q", "k",
                                                                                                           "v"]))
    record = []
    torch.compile(model, backend=fusing_backend(record))(torch.randn(2, 5, 16))
    assert [r[1] for r in record] == [fused]


def test_prepared_blocks_run_the_pass_under_inductor(monkeypatch):
    """prepare's compiled LoRA blocks hand the pass to inductor, which runs it before tracing the backward
    (caches off, so the graph is really compiled here)."""
    ran = []
    fuse = lora_fusion.fuse_lora_down
    monkeypatch.setattr(lora_fusion, "fuse_lora_down", lambda graph: ran.append(fuse(graph)) or ran[-1])
    loss, grads = loss_and_grads_21(lora_21())
    with torch._inductor.config.patch(force_disable_caches=True):
        model = lora_21(compile_blocks=True)
        compiled_loss, compiled_grads = loss_and_grads_21(model)
    assert ran and all(n == 2 for n in ran)
    assert torch.allclose(loss, compiled_loss, rtol=1e-4)
    assert all(torch.allclose(grads[n], compiled_grads[n], rtol=1e-3, atol=1e-6) for n in grads)


def test_compile_options_keep_the_mode_s_settings():
    assert lora_fusion.compile_options(None) == {"pre_grad_custom_pass": lora_fusion.PASS}
    assert lora_fusion.compile_options("max-autotune-no-cudagraphs")["max_autotune"] is True


def test_the_compiling_call_saves_what_later_calls_save():
    """The pass runs inside the first call. A checkpointed block counts the tensors its forward saves and checks the
    recomputation saves as many, so compiling must save nothing of its own (caches off: really compiled here)."""
    model = peft.get_peft_model(Projections(), peft.LoraConfig(r=2, target_modules=["q", "k", "v"]))
    compiled = torch.compile(model, options=lora_fusion.compile_options(None))
    x = torch.randn(2, 5, 16, requires_grad=True)
    counts = []
    with torch._inductor.config.patch(force_disable_caches=True):
        for call in range(2):
            counts.append(0)

            def pack(t, call=call):
                counts[call] += 1
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                compiled(x)
        y = torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False)
        y.square().sum().backward()
    assert counts[0] == counts[1] > 0 and x.grad.abs().sum() > 0
