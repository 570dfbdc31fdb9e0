"""The ZeRO step with train/runtime/ds_patches.py's lighter host work against DeepSpeed's own methods, on two CPU
ranks over gloo (bf16, ZeRO-2, clipping, AdamW on torch's kernels as the trainer builds its engine on a CPU): the same
weights, norms and skipped steps, with one host synchronisation per step."""

from __future__ import annotations

import pytest
import torch
from ranks import Ranks

STEPS = 5
CLIPPED, POISONED = 1, 3  # the step whose gradients are scaled far past the clip, the one with a NaN on rank 0


def _train(rank: int, world: int, lean: bool, moved: bool = False) -> dict:
    """One rank: STEPS steps of a small bf16 ZeRO-2 engine with the lighter step in (`lean`) or out; `moved`: one
    parameter's data is replaced by a copy before the last step, as a checkpoint load may leave it. Returns the
    weights, the engine's norms and skipped steps, and the host synchronisations (aten._local_scalar_dense) of each
    engine.step() outside the wrapped optimizer's own step."""
    import deepspeed
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from train.runtime import ds_patches

    class Syncs(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Syncs.count += 1
            return func(*args, **(kwargs or {}))

    assert ds_patches.apply()
    ds_patches.lean_step(lean)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inner = engine.optimizer.optimizer  # torch's AdamW reads its step count on the host (not so FusedAdam on a GPU):
    inner_step = inner.step  # its syncs are not the ZeRO step's and are left out of the count

    def step_uncounted(*args, **kwargs):
        before = Syncs.count
        try:
            return inner_step(*args, **kwargs)
        finally:
            Syncs.count = before

    inner.step = step_uncounted
    generator = torch.Generator().manual_seed(rank)
    syncs, norms = [], []
    for step in range(STEPS):
        x = torch.randn(4, 32, generator=generator).to(torch.bfloat16)
        loss = engine(x).float().square().mean() * (1e4 if step == CLIPPED else 1.0)
        if step == POISONED and rank == 0:
            loss = loss * float("nan")
        engine.backward(loss)
        if moved and step == STEPS - 1:
            first = next(model.parameters())
            first.data = first.data.clone()
        before = Syncs.count
        with Syncs():
            engine.step()
        syncs.append(Syncs.count - before)
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    flat = engine.optimizer.bit16_groups_flat[0]
    in_flat = [flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
               for p in model.parameters()]
    ds_patches.lean_step(True)
    return {"weights": [p.detach().float().clone() for p in model.parameters()], "norms": norms, "syncs": syncs,
            "skipped": engine.skipped_steps, "in_flat": in_flat}


@pytest.fixture(scope="module")
def two_ranks():
    ranks = Ranks(2)
    yield ranks
    ranks.close()


def test_lean_step_equals_deepspeeds_with_one_host_sync(two_ranks):
    """Both ranks, DeepSpeed's step and the lighter one: the same weights bit for bit after clipped, plain and skipped
    steps, the same global norms (inf for the step a rank's NaN poisoned: skipped on both ranks), and the lighter step
    synchronises the host once per step where DeepSpeed's does more."""
    theirs, ours = two_ranks.run(_train, False), two_ranks.run(_train, True)
    for rank in range(two_ranks.world):
        a, b = theirs[rank], ours[rank]
        assert a["skipped"] == b["skipped"] == 1
        assert a["norms"] == b["norms"]
        assert a["norms"][POISONED] == float("inf")
        assert a["norms"][CLIPPED] > 100 * max(n for i, n in enumerate(a["norms"]) if i not in (CLIPPED, POISONED))
        for wa, wb in zip(a["weights"], b["weights"], strict=True):
            assert torch.equal(wa, wb)
        assert b["syncs"] == [1] * STEPS, b["syncs"]
        assert all(n > 1 for i, n in enumerate(a["syncs"]) if i != POISONED), a["syncs"]  # a skip returns early
        assert all(a["in_flat"]) and all(b["in_flat"])


def test_a_moved_parameter_is_pointed_back_at_the_flat_buffer(two_ranks):
    """A parameter whose data was replaced by a copy views its slice of DeepSpeed's flat buffer again after the next
    step, with the weights DeepSpeed's own step gives."""
    theirs, ours = two_ranks.run(_train, False, True), two_ranks.run(_train, True, True)
    for rank in range(two_ranks.world):
        assert all(ours[rank]["in_flat"])
        for wa, wb in zip(theirs[rank]["weights"], ours[rank]["weights"], strict=True):
            assert torch.equal(wa, wb)

