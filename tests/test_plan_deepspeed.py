"""The plan's per-parameter bytes against DeepSpeed's own buffers, on CPU ranks over gloo as the trainer builds
its engine: ZeRO state at the backward's peak and in the step (stages 0, 1, 2), the gradient buckets, and under the
optimizer offload the GPU's bf16 side and the host's pinned buffers and moments."""

from __future__ import annotations

import pytest
from ranks import Ranks

from train.plan.sizes import (
    Sizes,
    bucket_sizes,
    optimizer_host_bytes,
    pinned_bytes,
    state_bytes_per_param,
    trainable_pinned_bf16,
)


def _live_storages(params=(), dtype=None, excluded=frozenset()) -> dict[int, tuple[int, str]]:
    """{data pointer: (bytes, "dtype numel" of a tensor on it)} of every tensor storage alive in this process (under
    _counting_from_here, of those made since the job began), or only of tensors of `dtype`, less the storages whose
    data pointers are `excluded`: the tensors Python holds, and the gradients of `params` (autograd makes them in
    C++, where gc does not see them until they are read)."""
    import gc

    import torch

    gc.collect()
    seen = {}
    for obj in [*gc.get_objects(), *(p.grad for p in params)]:
        if isinstance(obj, torch.Tensor) and not obj.is_meta and dtype in (None, obj.dtype):
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = (storage.nbytes(), f"{obj.dtype} {obj.numel()}")
    return {ptr: v for ptr, v in seen.items() if ptr and ptr not in excluded}


def _total(storages: dict[int, tuple[int, str]]) -> int:
    """The bytes of _live_storages' storages (each once)."""
    return sum(n for n, _ in storages.values())


def _live_bytes(params=(), dtype=None, excluded=frozenset()) -> int:
    return _total(_live_storages(params, dtype, excluded))


def _largest(storages: dict[int, tuple[int, str]], count: int = 6) -> list[str]:
    """The `count` largest of _live_storages' storages, for a failure's message."""
    return [f"{text} ({nbytes} bytes)" for nbytes, text in sorted(storages.values(), reverse=True)[:count]]


def _counting_from_here(rank: int, world: int, job, *args):
    """Run job(rank, world, *args) with what the process holds at its start frozen (gc.freeze): _live_bytes then
    collects and walks only the objects made since, which are all that a job counts (bytes above its start). A full
    collection and walk of every object of a process with torch and DeepSpeed loaded took 0.6 s, at each of a
    backward's reductions."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        return job(rank, world, *args)
    finally:
        gc.unfreeze()


def _step_transient(step) -> int:
    """The peak of the bytes `step()` allocates above what was alive when it began (torch's profiler counts every
    CPU allocation and free while it runs)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return max([0] + [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"])


def _adamw(zero: dict, **top) -> dict:
    """A DeepSpeed config of bf16 AdamW (torch_adam: torch's, not DeepSpeed's fused GPU kernel) with `zero`."""
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    return {
        "train_micro_batch_size_per_gpu": 1,
        **top,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": optimizer,
    }


def _zero_state_per_param(rank: int, world: int, stage: int) -> dict:
    """One rank of test_zero_state_bytes_are_deepspeeds_buffers: this rank's bytes per trainable parameter under
    ZeRO `stage` when the backward's gradients are all there (before DeepSpeed reduces them), after the backward,
    and at the peak of the optimizer step."""
    import deepspeed
    import torch

    base = _live_bytes()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    config = _adamw(
        {
            "stage": stage,
            "overlap_comm": False,
            "contiguous_gradients": stage == 2,
            "reduce_bucket_size": 10_000,
            "allgather_bucket_size": 10_000,
        }
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()  # the Adam moments exist from here on
    engine.optimizer.optimizer.step = lambda *a, **k: None  # the GPU's FusedAdam updates in place: no allocation
    seen = {}
    reduce = getattr(engine.optimizer, "reduce_gradients", None)
    if reduce is not None:

        def measured_reduce(*a, **k):
            seen["before_reduce"] = _live_bytes(engine.module.parameters()) - base
            return reduce(*a, **k)

        engine.optimizer.reduce_gradients = measured_reduce
    engine.backward(engine(x).float().square().mean())
    torch.distributed.barrier()  # the backward's all-reduce has finished on both ranks before its buffers are counted
    storages = _live_storages(engine.module.parameters())
    seen["after_backward"] = _total(storages) - base
    seen["in_step"] = seen["after_backward"] + _step_transient(engine.step)
    return {**{k: v / n for k, v in seen.items()}, "largest_after_backward": _largest(storages)}


@pytest.fixture(scope="module")
def two_ranks():
    """Two CPU ranks over gloo for the cases of this module whose measurements are relative to the job's start."""
    ranks = Ranks(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def one_rank():
    ranks = Ranks(1)
    yield ranks
    ranks.close()


@pytest.fixture
def fresh_two_ranks():
    """Two new ranks for one case: in ranks that had run earlier jobs, the offloaded optimizer's device bytes came
    out 1.5-3.5x what a fresh process measures (tensors the earlier engines left behind join the count)."""
    ranks = Ranks(2)
    yield ranks
    ranks.close()


def test_zero_state_bytes_are_deepspeeds_buffers(two_ranks):
    """The plan's bytes per trainable parameter (state_bytes_per_param) against DeepSpeed's own buffers on 2 ranks
    (gloo, bf16, its ZeRO optimizer as the trainer builds it): at the backward's peak (every gradient there, before
    the reduction) and in the optimizer step, for stages 0, 1 and 2. Stage 0 holds everything on every rank;
    stages 1 and 2 split the master weights and moments (stage 2 the gradients too)."""
    world = two_ranks.world
    for stage in (0, 1, 2):
        for rank, seen in two_ranks.run(_counting_from_here, _zero_state_per_param, stage).items():
            backward = state_bytes_per_param(False, stage, world, False)
            in_step = state_bytes_per_param(False, stage, world, False, in_step=True)
            peak = max(seen.get("before_reduce", 0), seen["after_backward"])
            assert peak == pytest.approx(backward, abs=0.05), (rank, stage, seen)
            assert seen["in_step"] == pytest.approx(in_step, abs=0.05), (rank, stage, seen)
    assert state_bytes_per_param(False, 2, 1, False) == 16  # one GPU: what the single-GPU plan counted


def _bucket_buffers(rank: int, world: int, zero: dict) -> int:
    """One rank of test_the_counted_buckets_are_deepspeeds: the largest total of DeepSpeed's gradient bucket buffers
    seen at any module's backward, over two steps, with the zero_optimization section `zero`."""
    import deepspeed
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    config = _adamw(zero)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seen = [0]

    def hook(*args):
        buckets = getattr(engine.optimizer, "ipg_buckets", {})
        seen.append(sum(t.numel() * t.element_size() for b in buckets.values() for t in b.buffer))

    for layer in engine.module:
        layer.register_full_backward_hook(hook)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    return max(seen)


@pytest.mark.parametrize(
    "stage,overlap,contiguous,offload",
    [
        (0, True, True, False),
        (1, False, True, False),
        (1, True, True, True),
        (2, True, True, False),
        (2, False, True, False),
        (2, True, False, False),
        (2, True, False, True),
        (2, False, False, True),
    ],
)
def test_the_counted_buckets_are_deepspeeds(one_rank, stage, overlap, contiguous, offload):
    """The plan's gradient buckets (Sizes.bucket_bytes from the config's zero_optimization) against the buffers
    DeepSpeed allocates while the backward runs: two with overlap_comm (zero2.json's), one without, none without
    contiguous gradients unless its optimizer offload turns them on, none at stage 0. A 16 GB plan that counted one
    of zero2.json's two 0.4 GB buckets chose a setting that ran out of memory at step 1 (docs/performance.md)."""
    zero = {"stage": stage, "overlap_comm": overlap, "contiguous_gradients": contiguous, "reduce_bucket_size": 30_000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    sizes = Sizes(1, 1, 1, 1, 1, 0, 1, zero_stage=stage, **bucket_sizes({"zero_optimization": zero}))
    for rank, seen in one_rank.run(_bucket_buffers, zero).items():
        assert seen == sizes.bucket_bytes(offload), (rank, seen, sizes)
    if stage == 2 and overlap and contiguous:
        assert seen == 2 * 30_000 * 2  # two bf16 buckets: the case the shipped zero2.json runs


def _partition_during_backward(rank: int, world: int, bucket: int) -> dict:
    """One rank of test_the_gradient_partition_comes_with_the_first_reduced_bucket: for 8 layers of 65,792
    parameters under zero2.json's ZeRO settings with a bucket of `bucket` elements, whether DeepSpeed's bf16 gradient
    partition exists when each layer's backward has ended (in the backward's order), over two steps, and its size."""
    import deepspeed
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_adamw(zero))
    optimizer, present, sizes = engine.optimizer, [], set()

    def hook(*args):
        partition = optimizer.grads_in_partition
        present[-1].append(partition is not None)
        if partition is not None:
            sizes.add(partition.numel())

    for layer in engine.module:
        layer.register_full_backward_hook(hook)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        present.append([])
        engine.backward(engine(x).float().square().mean())
        engine.step()
    return {"present": present, "sizes": sorted(sizes)}


@pytest.mark.parametrize("bucket", [10_000_000, 150_000, 60_000])
def test_the_gradient_partition_comes_with_the_first_reduced_bucket(one_rank, bucket):
    """ZeRO stage 2 allocates its bf16 gradient partition when it reduces its first bucket, so at a peak of the
    backward it exists only once more gradients than a bucket holds have been made: never, for gradients that fit one
    bucket (LoRA's, 2e8 elements to a bucket), before the epilogue. Sizes.unreduced_partition_bytes says the same
    after each layer of 8, for a bucket larger than all of them, one that the third layer overflows and one that the
    first does; what it counts is the partition's size."""
    import dataclasses

    per_layer = 256 * 256 + 256
    s = Sizes(8, per_layer, per_layer, 0, 0, 0, 0, full=True, zero_stage=2,
              **bucket_sizes({"zero_optimization": {"reduce_bucket_size": bucket, "overlap_comm": True}}))
    counted = [s.unreduced_partition_bytes(False, done) == 0 for done in range(1, 9)]
    assert counted == [done * per_layer > bucket for done in range(1, 9)]
    for rank, seen in one_rank.run(_partition_during_backward, bucket).items():
        assert seen["present"] == [counted, counted], (rank, bucket, seen)
        assert seen["sizes"] == ([] if not any(counted) else [8 * per_layer]), (rank, seen)
    if not counted[0]:  # what is left out: the partition DeepSpeed allocates later, in bf16
        assert s.unreduced_partition_bytes(False, 1) == 8 * per_layer * 2
    # where the partition may exist at any peak, it is counted as present
    for other in ({"zero_stage": 1}, {"accumulating": True}, {"fp32_buckets": True},
                  {"contiguous_gradients": False}):
        assert dataclasses.replace(s, **other).unreduced_partition_bytes(False, 1) == 0, other
    assert s.unreduced_partition_bytes(True, 1) == 0  # the optimizer offload: no partition on the GPU to leave out


def _offloaded_device_bytes(rank: int, world: int, stage: int) -> dict:
    """One rank of test_offloaded_optimizer_device_bytes_are_deepspeeds: under DeepSpeed's optimizer offload the
    device side is bf16 (weights, gradients, the reduction bucket) and the host side fp32 (master, gradients,
    moments) plus two bf16 buffers of its own, left out here by name: the pinned copy of the updated weights
    (counted by host_state_bytes) and a staging buffer of the largest parameter's size (its device twin,
    temp_grad_buffer_for_gpu_offload, is left out too: a constant, 75 MB at full size, like the bucket). Bytes per
    parameter of the rest above the process's before the model, at each reduction (stage 2 reduces bucket by
    bucket during the backward, stage 1 once after it) and after the backward: the largest."""
    import deepspeed
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    config = _adamw(
        {
            "stage": stage,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_bucket_size": 10_000,
            "allgather_bucket_size": 10_000,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        }
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    opt = engine.optimizer
    buffers = [
        *opt.param_buffer_of_bit16_for_cpu_offload_groups,
        opt.temp_grad_buffer_for_cpu_offload,
        opt.temp_grad_buffer_for_gpu_offload,
    ]
    left_out = frozenset(t.untyped_storage().data_ptr() for t in buffers)
    params = list(engine.module.parameters())

    def device_bytes() -> int:
        return _live_bytes(params, torch.bfloat16, left_out)

    seen = []
    name = "reduce_ipg_grads" if stage == 2 else "reduce_gradients"
    reduce = getattr(opt, name)

    def measured_reduce(*a, **k):
        seen.append(device_bytes())
        return reduce(*a, **k)

    setattr(opt, name, measured_reduce)
    # two measured backwards, the lower peak kept: on a loaded machine one backward once showed a second gradient in
    # flight beside the counted one (a timing, not a buffer DeepSpeed keeps); a buffer shows in both
    peaks, reductions = [], []
    for _ in range(2):
        seen.clear()
        engine.backward(engine(x).float().square().mean())
        seen.append(device_bytes())
        peaks.append(max(seen))
        reductions.append(len(seen) - 1)
        engine.step()
    return {
        "weights": sum(p.numel() * 2 for p in params) / n,
        "peak": min(peaks) / n,
        "largest": max(p.numel() * 2 for p in params) / n,
        "reductions": min(reductions),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_optimizer_device_bytes_are_deepspeeds(fresh_two_ranks, stage):
    """Under optimizer offload the plan counts on each GPU, per trainable parameter, its bf16 weight (a LoRA
    parameter's) and at stage 1 its bf16 gradient; at stage 2 DeepSpeed frees each gradient once its bucket has gone
    to the host, so none is counted (the bucket is, apart), beyond the one gradient autograd has just made and its
    hook has not yet copied into the bucket (at most the largest parameter's: 75 MB at full size, within the margin).
    Against DeepSpeed on 2 ranks; the H200 showed the same at full size (docs/performance.md "The last resort")."""
    # not under _counting_from_here: on a loaded machine the count came out one gradient-sized bf16 tensor higher (one
    # run in two) with a frozen start and ranks that imported DeepSpeed's Muon module uncompiled; never in six runs
    # without either
    for rank, seen in fresh_two_ranks.run(_offloaded_device_bytes, stage).items():
        assert seen["weights"] == 2 and seen["reductions"] >= 1, seen
        counted = state_bytes_per_param(False, stage, 2, True) + (seen["largest"] if stage == 2 else 0)
        assert seen["peak"] == pytest.approx(counted, abs=0.05), (rank, stage, seen)
    assert state_bytes_per_param(False, 2, 2, True) == 2 and state_bytes_per_param(False, 1, 2, True) == 4


def _offload_host_buffers(rank: int, world: int, accumulation: int) -> dict:
    """One rank of test_offloaded_optimizer_host_bytes_are_deepspeeds_buffers: the bytes of every tensor DeepSpeed
    pins under optimizer offload (recorded at its accelerator's pin_memory: at start, then in the steps) and of the
    Adam moments, after two optimizer steps of `accumulation` micro-steps each."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    pinned = []
    accelerator = get_accelerator()
    pin = accelerator.pin_memory

    def recorded_pin(tensor, *args, **kwargs):
        pinned.append(tensor.numel() * tensor.element_size())
        return pin(tensor, *args, **kwargs)

    accelerator.pin_memory = recorded_pin
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        n = sum(p.numel() for p in model.parameters())
        config = _adamw(
            {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            gradient_accumulation_steps=accumulation,
        )
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        at_start = len(pinned)
        x = torch.randn(4, 512, dtype=torch.bfloat16)
        for _ in range(2 * accumulation):
            engine.backward(engine(x).float().square().mean())
            engine.step()
    finally:  # the rank runs other cases after this one
        accelerator.pin_memory = pin
    moments = sum(
        t.numel() * t.element_size()
        for state in engine.optimizer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "n": n,
        "largest": 512 * 512,
        "pinned": sorted(pinned[:at_start]),
        "in_steps": sorted(pinned[at_start:]),
        "moments": moments,
        "numels": [p.numel() for p in model.parameters()],
    }


@pytest.mark.parametrize("accumulation", [1, 2])
def test_offloaded_optimizer_host_bytes_are_deepspeeds_buffers(two_ranks, accumulation):
    """optimizer_host_bytes against what DeepSpeed's optimizer offload holds on each of 2 ranks (ZeRO 2, bf16, one
    parameter group as the trainer builds it): the pinned tensors are the fp32 master and gradient partitions, the
    bf16 copy of the partition and a bf16 buffer of the largest parameter, and the Adam moments are 8 bytes per
    parameter of the partition in ordinary memory. A pinned tensor costs the next power of two (torch's
    CachingHostAllocator), the reason a flat 18 bytes per parameter undercounts by ~20%. With gradient accumulation
    each rank also pins a bf16 tensor per parameter of its partition in the steps (4 weights and 4 biases here),
    counted by trainable_pinned_bf16 over the model's parameters and split over the ranks."""
    world = two_ranks.world
    for rank, seen in two_ranks.run(_offload_host_buffers, accumulation).items():
        part = seen["n"] // world  # 1,050,624 of the 2,101,248 parameters: the partition needs no padding
        assert seen["pinned"] == sorted([4 * part, 4 * part, 2 * part, 2 * seen["largest"]]), (rank, seen)
        assert seen["moments"] == 8 * part, (rank, seen)
        counted = sum(pinned_bytes(b) for b in seen["pinned"][1:]) + seen["moments"]  # less the small buffer
        if accumulation == 1:
            assert seen["in_steps"] == [] and optimizer_host_bytes(seen["n"], world) == counted, (rank, seen)
            continue
        assert seen["in_steps"] == sorted([2 * 512] * 4 + [2 * 512 * 512] * 4), (rank, seen)
        counted += sum(pinned_bytes(b) for b in seen["in_steps"])
        accumulated = trainable_pinned_bf16(seen["numels"])
        assert optimizer_host_bytes(seen["n"], world, accumulated) == counted, (rank, seen)
