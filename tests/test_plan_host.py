"""Host memory in the plan (train/plan/host.py, counted by choice.host_bytes): the pinned offloaded blocks and the
offloaded optimizer state per node, one shared copy in /dev/shm, a host too small for the choice, a config's own
offload count that the host cannot hold, and the node's figures gathered from every rank."""

from __future__ import annotations

import pytest
from plan_helpers import QWEN_LORA, measured, plan
from recorded_plans import RELEASED

from train.config import Config, ProjectConfig
from train.model import offload
from train.plan import host as host_memory
from train.plan.explain import PlanError, host_refusal
from train.plan.host import Host, node_host
from train.plan.predict import Choice, host_bytes
from train.plan.run_plan import check_offload_host, gpu_margin
from train.plan.sizes import GB, moved_bytes, optimizer_host_bytes


def test_offloaded_blocks_count_against_the_host():
    """Every process pins its own offloaded blocks: P x K x a block's fp8 matrices (0.34 GB) per node, plus the
    offloaded optimizer's partitions. A host that cannot hold the plan's choice gets a plan with fewer offloaded
    blocks (a slower step, never more offload than fits); when no setting that fits the GPU fits the host, the
    refusal has the host's figures and what to change."""
    m = measured(8_448)
    budget = 24 * GB
    margin = gpu_margin(0, budget)
    free, p_free = plan(RELEASED, m, budget, margin, {}, fp8_ok=True, online=False)
    assert free.offloaded > 40 and not free.offload_optimizer
    block = moved_bytes(RELEASED, True)
    assert block == pytest.approx(0.34 * GB, rel=0.01) and moved_bytes(RELEASED, False) == 2 * block
    one = Host(64 * GB, ranks_per_node=1, world_size=1)
    assert host_bytes(RELEASED, free, one) == free.offloaded * block
    eight = Host(500 * GB, ranks_per_node=8, world_size=8)
    assert host_bytes(RELEASED, free, eight) == 8 * free.offloaded * block
    both = Choice(True, False, 60, 10, True, offload_optimizer=True)
    state = 8 * optimizer_host_bytes(RELEASED.lora_params, 8)  # split over the world, all of it on one node
    assert host_bytes(RELEASED, both, eight) == pytest.approx(8 * 10 * block + state)
    assert eight.margin_bytes == pytest.approx(8 * 2 * GB + 25 * GB) and Host().margin_bytes == 0
    # a roomy host changes nothing
    assert plan(RELEASED, m, budget, margin, {}, True, False, host=eight) == (free, p_free)
    # eight processes on a host whose room (125 GB) is short of their 8 x 52 blocks (141 GB): another candidate,
    # fewer blocks each beside the optimizer's offloaded state (8.8 GB on the node), a slower step
    short = Host((125 * GB + 16 * GB) / 0.95, ranks_per_node=8, world_size=8)
    assert short.room_bytes == pytest.approx(125 * GB)
    c, p = plan(RELEASED, m, budget, margin, {}, True, False, host=short)
    assert 0 < c.offloaded < free.offloaded and c.offload_optimizer and p.peak_bytes <= budget - margin
    assert p.step_s + p.optimizer_s > p_free.step_s
    assert host_bytes(RELEASED, c, short) <= short.room_bytes < host_bytes(RELEASED, free, short)
    # eight processes on 100 GB: nothing that fits the GPU fits the host
    with pytest.raises(PlanError) as e:
        plan(RELEASED, m, budget, margin, {}, True, False, host=Host(100 * GB, 8, 8))
    text = str(e.value)
    assert text.startswith(
        "nothing fits this node's host memory: only settings that pin host memory fit the GPU budget (24.0 GB"
    )
    assert "8 training process(es) on this node x 35 offloaded blocks x 0.34 GB (fp8 weights)" in text
    assert "+ 8.8 GB of DeepSpeed's offloaded optimizer state" in text  # the least host memory of those: with it
    assert "100.0 GB is available, less a 21.0 GB margin" in text
    for fix in ("deepspeed --num_gpus", "qwen_edit.memory.budget_gb", 'data.cache "auto"', "data.num_workers"):
        assert fix in text, fix
    assert "offload_blocks = " not in text  # not set in the config: nothing to unpin
    # a budget where nothing needs offloading never asks the host
    c80, _ = plan(RELEASED, m, 80 * GB, gpu_margin(0, 80 * GB), {}, True, False, host=Host(1 * GB, 8, 8))
    assert c80.offloaded == 0 and not c80.offload_optimizer


def test_an_explicit_offload_count_that_the_host_cannot_hold_names_the_key(released_model):
    """train.offload_blocks set in the config: with the plan, a refusal that names the key; with memory.plan off
    (the config as written), check_offload_host stops the run before loading, naming it; a count that fits passes."""
    m = measured(8_448)
    host = Host(64 * GB, ranks_per_node=4, world_size=4)
    with pytest.raises(PlanError) as e:
        plan(RELEASED, m, 24 * GB, 2.7 * GB, {"train.offload_blocks": 60}, True, False, host=host)
    text = str(e.value)
    assert "x 60 offloaded blocks" in text and "qwen_edit.train.offload_blocks = 60 is set in the config" in text

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    cfg = Config(project=ProjectConfig(lora=QWEN_LORA), deepspeed=ds, explicit=frozenset({"train.offload_blocks"}))
    cfg.project.model.path = str(released_model)
    cfg.project.train.offload_blocks, cfg.project.train.fp8_base = 40, True
    with pytest.raises(PlanError) as e:
        check_offload_host(cfg, host)  # 4 x 40 x 0.34 GB = 54.4 GB of 64 - 11.2
    text = str(e.value)
    assert text.startswith("qwen_edit.train.offload_blocks = 40 does not fit this node's host memory")
    assert "54.4 GB of pinned host memory (4 training process(es) on this node x 40 offloaded blocks" in text
    assert "deepspeed --num_gpus" in text
    cfg.project.train.offload_blocks = 20
    check_offload_host(cfg, host)  # 27.2 GB: fits
    cfg.deepspeed["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # + 7.6 GB of optimizer state
    check_offload_host(cfg, host)
    with pytest.raises(PlanError, match="offloaded optimizer state"):
        check_offload_host(cfg, Host(40 * GB, 4, 4))
    cfg.project.train.offload_blocks = 0
    check_offload_host(cfg, Host(0, 8, 8))  # nothing offloaded: nothing to check


def test_node_host_is_the_smallest_any_rank_sees(monkeypatch):
    monkeypatch.setattr(host_memory, "_host_available", lambda: 123 * GB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(offload, "shm_free_bytes", lambda: 30 * GB)
    assert node_host(8) == Host(123 * GB, 4, 8, 30 * GB)


def test_one_shared_copy_of_offloaded_blocks_is_counted_once_per_node():
    """Where /dev/shm holds the offloaded blocks (with offload.SHM_SPARE_BYTES to spare) and several processes
    train on the node, the plan counts one copy of them for the node, as the offloader then keeps; otherwise one per
    process. On 8 processes of a 24 GB budget with 64 GB of host memory, only the shared copy lets the plan offload
    what the GPU needs."""
    c = Choice(True, False, 60, 40, True)
    blocks = 40 * moved_bytes(RELEASED, True)
    roomy = Host(500 * GB, 8, 8, shm_bytes=blocks + 3 * GB)
    tight = Host(500 * GB, 8, 8, shm_bytes=blocks + 1 * GB)  # under the spare
    assert host_bytes(RELEASED, c, roomy) == pytest.approx(blocks)
    assert host_bytes(RELEASED, c, tight) == pytest.approx(8 * blocks)
    assert "one copy for the node's 8 training processes" in host_refusal(RELEASED, c, roomy, {})
    assert "8 training process(es) on this node x 40" in host_refusal(RELEASED, c, tight, {})
    m, budget = measured(8_448), 24 * GB
    margin = gpu_margin(0, budget)
    shared = Host(64 * GB, 8, 8, shm_bytes=32 * GB)
    chosen, _ = plan(RELEASED, m, budget, margin, {}, fp8_ok=True, online=False, host=shared)
    assert chosen.offloaded > 40 and not chosen.offload_optimizer
    assert host_bytes(RELEASED, chosen, shared) <= shared.room_bytes
    with pytest.raises(PlanError, match="nothing fits this node's host memory"):
        plan(RELEASED, m, budget, margin, {}, fp8_ok=True, online=False, host=Host(64 * GB, 8, 8, shm_bytes=0))
