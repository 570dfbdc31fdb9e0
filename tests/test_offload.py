"""Block offloading (train/model/offload.py) and the streaming loader (train/model/streaming.py) on the tiny model,
fp32 CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import transformer_inputs

from train.config import LoraConfig, ModelConfig
from train.model import family, fp8, loading, prepare, streaming
from train.model.qwen_image.tiny import build_transformer

LORA = LoraConfig(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_out.0", "img_mlp.net.2"])


def _prepared(num_layers: int, offload: set[int], checkpoint_blocks: int = 0):
    torch.manual_seed(0)
    model = build_transformer(num_layers=num_layers)
    offloader = prepare.prepare_for_training(model, "lora", LORA, True, False, checkpoint_blocks=checkpoint_blocks,
                                            offload=offload)
    return model.train(), offloader


def _loss_and_grads(model, steps: int = 2):
    grads = []
    for step in range(steps):
        inputs = transformer_inputs(model, generator=torch.Generator().manual_seed(step))
        loss = model(**inputs)[0].square().mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("offload, checkpoint_blocks", [({0, 1, 2, 3}, 0), ({0, 1}, 3)])
def test_offloaded_blocks_train_exactly_like_resident_ones(offload, checkpoint_blocks):
    resident, _ = _prepared(4, set(), checkpoint_blocks)
    offloaded, offloader = _prepared(4, offload, checkpoint_blocks)
    loss_a, grads_a = _loss_and_grads(resident)
    loss_b, grads_b = _loss_and_grads(offloaded)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Every block use but the first was prefetched. A step copies each block twice (forward, recomputation) except
    # where a pass turns: the two blocks last used in the forward start the backward still in their slots, and
    # the two last used in the backward start the next forward: 2n - 2 copies in the first step, 2n - 4 after.
    assert offloader.waited == 1
    n = len(offload)
    assert offloader.copies == (2 * n - 2) + (2 * n - 4) if n > 2 else offloader.copies == 2


def test_offloaded_weights_leave_the_module():
    model, offloader = _prepared(3, {0, 1, 2})
    for i in range(3):
        block = model.transformer_blocks[i]
        assert not [p for p in block.parameters() if not p.requires_grad and p.dim() == 2]  # none left to DeepSpeed
        frozen = [block.attn.to_q.base_layer.weight, block.attn.to_k.weight, block.img_mlp.net[2].base_layer.weight]
        assert all(p.untyped_storage().nbytes() == 4 for p in frozen)  # one-element placeholders
        assert all(p.isnan().all() for p in frozen)  # a read outside fetch() would show as NaN
    assert offloader.host_bytes > 2 * offloader.device_bytes / 2  # three blocks on the host, two slots on device
    # no_grad forward (validation renders) binds the weights too
    with torch.no_grad():
        out = model(**transformer_inputs(model, generator=torch.Generator().manual_seed(0)))[0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("refused", [False, True])
def test_the_host_buffer_is_pinned_in_place_at_its_size(monkeypatch, capsys, refused):
    """On a GPU the filled host buffer is registered with CUDA as it is, exactly its bytes (torch's pinned tensors
    are rounded up to a power of two: a 0.34 GB fp8 block would cost 0.54 GB), and unregistered when the offloader
    goes, before its memory is freed. Where CUDA refuses, a pinned copy from torch replaces it and the log says so.
    CUDA is faked here; the blocks are the tiny model's."""
    import gc

    from train.model import offload

    model, offloader = _prepared(3, {0, 1, 2})
    whole = offloader._whole
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 1 if refused else 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize",)))
    monkeypatch.setattr(offload, "_pinned_copy", lambda t: t.clone())
    before = {i: buf.clone() for i, buf in offloader.host.items()}
    offloader._pin()
    total = sum(layout.nbytes for layout in offloader.layouts.values())
    assert calls == [("register", whole.data_ptr(), total, offload.CUDA_HOST_REGISTER_PORTABLE)]
    assert offloader.host_bytes == total == whole.numel()
    assert all(torch.equal(offloader.host[i], before[i]) for i in before)  # the blocks' bytes, wherever they are
    outside = [buf.data_ptr() < whole.data_ptr() or buf.data_ptr() >= whole.data_ptr() + total
               for buf in offloader.host.values()]
    assert all(outside) if refused else not any(outside)
    assert ("pinned copy of its own" in capsys.readouterr().out) == refused
    offloader.remove()
    del model, offloader
    gc.collect()
    if refused:  # nothing was registered, so nothing is unregistered
        assert len(calls) == 1
    else:
        assert calls[1:] == [("synchronize",), ("unregister", whole.data_ptr())]


def test_streamed_weights_equal_from_pretrained(tiny_edit, tmp_path):
    model_dir = tiny_edit / "model"
    reference = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    streamed, quantized = streaming.load(model_dir, streaming.Placement(torch.device("cpu"), torch.float32),
                                         frozen=True)
    assert not quantized
    ref_state, got_state = reference.state_dict(), streamed.state_dict()
    assert ref_state.keys() == got_state.keys()
    for name, t in ref_state.items():
        assert torch.equal(t, got_state[name]) and got_state[name].dtype == t.dtype, name
    # bf16 as from_pretrained(torch_dtype=bfloat16) casts
    ref16 = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.bfloat16).state_dict()
    got16, _ = streaming.load(model_dir, streaming.Placement(torch.device("cpu"), torch.bfloat16), frozen=True)
    assert all(torch.equal(t, got16.state_dict()[n]) for n, t in ref16.items())


def test_streamed_fp8_and_offloaded_placement(tiny_edit):
    model_dir = tiny_edit / "model"
    kind = family.family_named("qwen_image").fp8_kind
    placement = streaming.Placement(torch.device("cpu"), torch.float32, fp8=kind, offload={1})
    streamed, quantized = streaming.load(model_dir, placement, frozen=True)
    reference = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    names = [n for n, m in reference.named_modules() if kind(n)]
    assert sorted(quantized) == sorted(names)
    for name in names:
        q, scale = fp8.quantize_weight(reference.get_submodule(name).weight.detach())
        assert torch.equal(quantized[name][0].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(quantized[name][1], scale)
        # the nn.Linear left in the model holds a one-element placeholder until the fp8 swap
        assert streamed.get_submodule(name).weight.untyped_storage().nbytes() == 4


def test_load_for_training_matches_the_from_pretrained_path(tiny_edit):
    """The trainer's streamed build (fp8 base, block 1 offloaded) gives the same LoRA init, loss and LoRA gradients
    as from_pretrained + prepare_for_training without offloading."""
    model_dir = tiny_edit / "model"
    torch.manual_seed(3)
    reference = loading.load_transformer(ModelConfig(path=str(model_dir)), torch.float32)
    prepare.prepare_for_training(reference, "lora", LORA, True, False, fp8_base=True)
    torch.manual_seed(3)
    streamed, offloader = prepare.load_for_training(model_dir, torch.float32, torch.device("cpu"), "lora", LORA,
                                                   True, False, fp8_base=True, offload_blocks=1)
    assert offloader is not None and sorted(offloader.blocks) == [0]
    for (na, a), (nb, b) in zip(reference.named_parameters(), streamed.named_parameters(), strict=True):
        if a.requires_grad:
            assert na == nb and torch.equal(a, b), na
    loss_a, grads_a = _loss_and_grads(reference.train(), steps=1)
    loss_b, grads_b = _loss_and_grads(streamed.train(), steps=1)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[0][n], grads_b[0][n]) for n in grads_a[0])


def test_sharded_checkpoint_and_damaged_files(tmp_path):
    torch.manual_seed(0)
    model = build_transformer()
    model.save_pretrained(tmp_path / "m" / "transformer", max_shard_size="100KB")
    files = streaming.shard_files(tmp_path / "m" / "transformer")
    assert len(files) > 1
    loaded, _ = streaming.load(tmp_path / "m", streaming.Placement(torch.device("cpu"), torch.float32), frozen=True)
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in model.state_dict().items())
    files[-1].unlink()
    with pytest.raises(streaming.WeightsError, match="not in"):
        streaming.shard_files(tmp_path / "m" / "transformer")


def _shared_rank(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    """One process of test_node_shares_one_copy_of_offloaded_blocks: the trainer's streamed build with 2 blocks
    offloaded, as local rank `rank` of a node of `world` processes."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from train.model import offload

    loaded = {}  # whether this process read the offloaded matrices itself (a placeholder has stride 0)
    build = offload.BlockOffloader._shared_buffers

    def recording(self, share):
        loaded[share.writer] = [any(s != 0 for s in offload._get(o, n).stride())
                                for lay in self.layouts.values() for o, n, *_ in lay.entries]
        return build(self, share)

    offload.BlockOffloader._shared_buffers = recording
    from train.plan import run_plan

    share = run_plan.offload_share(model_dir, LORA, 2, True, 4)  # as the trainer decides it (fp32 here)
    torch.manual_seed(3)
    model, offloader = prepare.load_for_training(model_dir, torch.float32, torch.device("cpu"), "lora", LORA,
                                                    True, False, fp8_base=True, offload_blocks=2, share=share)
    loss, grads = _loss_and_grads(model.train(), steps=1)
    queue.put((rank, {"shared": offloader.shared, "loaded": loaded, "loss": loss.item(),
                      "grads": {n: g.tolist() for n, g in grads[0].items()}}))
    torch.distributed.destroy_process_group()


def test_node_shares_one_copy_of_offloaded_blocks(tiny_edit):
    """Two processes of one node (gloo, CPU) offloading 2 blocks share one host copy: the first process reads the
    offloaded weights and writes them into a file under /dev/shm that both map (the name is gone once both have
    it); the second reads none of them. Both train exactly as a resident build does."""
    import glob

    import torch.multiprocessing as mp
    from conftest import free_port

    from train.model import offload

    if offload.shm_free_bytes() < offload.SHM_SPARE_BYTES + 1e8:
        pytest.skip("no /dev/shm with room on this machine")
    model_dir = tiny_edit / "model"
    torch.manual_seed(3)
    reference, _ = prepare.load_for_training(model_dir, torch.float32, torch.device("cpu"), "lora", LORA, True,
                                                False, fp8_base=True)
    loss, grads = _loss_and_grads(reference.train(), steps=1)
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_shared_rank, args=(r, 2, port, str(model_dir), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert results[0]["loaded"] == {True: [True] * len(results[0]["loaded"][True])}  # the writer read them
    assert results[1]["loaded"] == {False: [False] * len(results[1]["loaded"][False])}  # the other did not
    for r in (0, 1):
        assert results[r]["shared"] and results[r]["loss"] == loss.item()
        assert all(torch.equal(torch.tensor(results[r]["grads"][n]), g) for n, g in grads[0].items())
    assert not glob.glob(str(offload.SHM_DIR / "qwen_edit_offload_*"))


def _share_decision(rank: int, world: int, port: int, shm_dirs: list[str], queue) -> None:
    """One process of test_no_sharing_where_a_process_sees_another_shm: node_share with its own /dev/shm."""
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from train.model import offload

    offload.SHM_DIR = Path(shm_dirs[rank])
    queue.put((rank, offload.node_share(1e6)))
    torch.distributed.destroy_process_group()


def test_no_sharing_where_a_process_sees_another_shm(tmp_path):
    """Two processes of one host name whose /dev/shm differ (a container each): the second does not see the file
    the first made, so neither shares (each loads and pins its own copy) and the file is removed."""
    import torch.multiprocessing as mp
    from conftest import free_port

    dirs = [tmp_path / "shm0", tmp_path / "shm1"]
    for d in dirs:
        d.mkdir()
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_share_decision, args=(r, 2, port, [str(d) for d in dirs], queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {0: None, 1: None}
    assert not [f for d in dirs for f in d.iterdir()]
