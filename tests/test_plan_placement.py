"""Placements beside training: train.infer's placement for a budget (train/plan/inference.py) and the cache
build's decision to stream the text encoder (train/plan/cache_plan.py)."""

from __future__ import annotations

import pytest
from recorded_plans import RELEASED

from train.plan.arch import component_bytes, streamed_vl_bytes
from train.plan.cache_plan import cache_vl_decision
from train.plan.explain import PlanError
from train.plan.host import Host
from train.plan.inference import (
    INFERENCE_ACTIVATION_BYTES,
    InferencePlacement,
    inference_allowance,
    inference_placement,
    inference_tokens,
)
from train.plan.run_plan import gpu_margin
from train.plan.sizes import GB


def test_inference_placement_follows_the_budget(released_model):
    """train.infer's placement for the released 2509 (40.9 GB transformer, 16.6 GB Qwen2.5-VL): everything on the
    GPU; else the encoders first and the transformer's first blocks streamed, as few as the room allows (Qwen2.5-VL
    streamed too where it does not fit); else diffusers' layer-by-layer offload."""
    s = RELEASED
    parts = {
        "transformer": (s.num_blocks * s.block_params + s.other_params) * 2,
        "text encoder": component_bytes(released_model, "text_encoder"),
        "VAE": component_bytes(released_model, "vae"),
    }
    block, streamed = s.block_params * 2, streamed_vl_bytes(released_model)
    assert parts["text encoder"] / GB == pytest.approx(16.6, abs=0.1) and streamed / GB < 4

    def placed(budget_gb):
        budget = budget_gb * GB
        return inference_placement(parts, block, s.num_blocks, budget, gpu_margin(0, budget), streamed)

    assert placed(141) == InferencePlacement("none")
    # 80 GB: 57.7 GB of models + 6 GB + 5.5 GB margin fit; 64 GB: the transformer alone fits after the encoders
    assert placed(80) == InferencePlacement("none")
    assert placed(64) == InferencePlacement("blocks", 0, False)
    # the rest of the transformer after the room: (room - embeddings and VAE - 2 slots) // 0.68 GB blocks resident
    for budget_gb in (48, 24, 16):
        room = budget_gb * GB - gpu_margin(0, budget_gb * GB) - INFERENCE_ACTIVATION_BYTES
        fixed = parts["transformer"] - s.num_blocks * block + parts["VAE"]
        resident = int((room - fixed - 2 * block) // block)
        assert placed(budget_gb) == InferencePlacement("blocks", 60 - resident, budget_gb < 24 + 1), budget_gb
    assert [placed(b).offload_blocks for b in (48, 24, 16)] == [7, 40, 52]  # the figures README.md quotes
    assert placed(8) == InferencePlacement("sequential")  # not even the streamed encoder fits with 6 GB
    # larger renders keep more room: 3 references at 2 MP are 32k tokens, 2.6x the measured shape's allowance
    assert inference_tokens(2, 1024 * 1024) == 12_288 and inference_allowance(12_288) == 6 * GB
    big = inference_tokens(3, 2 * 1024 * 1024)
    assert inference_allowance(big) == pytest.approx(6 * GB * big / 12_500)
    budget = 48 * GB
    wide = inference_placement(parts, block, s.num_blocks, budget, gpu_margin(0, budget), streamed, tokens=big)
    assert wide.offload_blocks - placed(48).offload_blocks == pytest.approx(
        (inference_allowance(big) - 6 * GB) / block, abs=1
    )
    # each process pins its own streamed copy: 40 blocks (27 GB) fit 48 GB of host memory once, not twice
    room = 48 * GB
    budget = 24 * GB
    args = (parts, block, s.num_blocks, budget, gpu_margin(0, budget), streamed)
    assert inference_placement(*args, Host(room, 1)).offload_blocks == 40
    with pytest.raises(PlanError, match=r"needs 54\.\d GB of pinned host memory on this node \(2 process"):
        inference_placement(*args, Host(room, 2))


def test_the_cache_build_streams_the_vl_encoder_only_when_it_must():
    """Resident needs 16.6 + 0.25 + 2 GB; at a 13.7 GB room the streamed 3.2 GB fits, and its line has the
    numbers; a room below the streamed need, or a host that cannot pin each process's copy, is a PlanError."""
    need = {"vl": 16.6 * GB, "vae": 0.25 * GB, "encode": 2 * GB, "streamed": 3.2 * GB}
    host = Host(120 * GB, ranks_per_node=1, world_size=1)
    line = cache_vl_decision(need, 13.7 * GB, 16 * GB, host)
    assert line.startswith(
        "latent cache: the VL encoder 16.6 GB + VAE 0.2 GB + the largest encode 2.0 GB do not fit "
        "the 13.7 GB that qwen_edit.memory.budget_gb 16.0 leaves"
    )
    assert "streamed block by block from 16.6 GB of pinned host memory" in line and "3.2 GB of it on the GPU" in line
    with pytest.raises(PlanError, match="needs 3.2 GB on the GPU") as e:
        cache_vl_decision(need, 5 * GB, 8 * GB, host)
    assert "python -m train.cache" in str(e.value)
    with pytest.raises(PlanError, match=r"132.8 GB of pinned host memory on this node \(8 process"):
        cache_vl_decision(need, 13.7 * GB, 16 * GB, Host(120 * GB, ranks_per_node=8, world_size=8))
