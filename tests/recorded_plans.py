"""Recorded plans: workloads the memory plan ran on, each with its inputs (the block figures the run measured at its
largest micro-batch, as tests/gpu_memory.sh records them under `plan_measured`; the sizes counted from the released
transformer's config; the budget and the config's fixed keys) and what the plan must choose from them (the setting
and its predicted peak, or the kind of refusal). One H200 measured them, with ds_configs/zero2.json. Each entry
takes a different branch of the choice; tests/test_plan_recorded.py runs the plan on every one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from train.plan.measure import Measured
from train.plan.predict import Choice
from train.plan.sizes import Sizes

# The released Qwen-Image-Edit transformer (v1 and 2509 count the same) with LoRA r64 on the default targets, as
# count_sizes counts it; the text encoder and VAE in bf16; zero2.json's two gradient buckets of 2e8 bf16 elements.
RELEASED = Sizes(
    num_blocks=60,
    block_params=339_831_296,
    block_matrix_params=339_738_624,
    block_fp8_params=339_738_624,
    block_token_params=226_492_416,
    other_params=40_523_328,
    lora_params=424_673_280,
    accumulation_pinned=1_132_462_080,
)
ENCODERS_BYTES = 16_838_118_374
ZERO2_BUCKETS = {"bucket": 4e8, "buckets": 2, "contiguous_gradients": True, "fp32_buckets": False}
CACHED = dataclasses.replace(RELEASED, **ZERO2_BUCKETS)
ONLINE = dataclasses.replace(CACHED, encoder_bytes=ENCODERS_BYTES, encode_ahead=True)


def full_fine_tune(num_blocks: int) -> Sizes:
    """A full fine-tune of the released transformer cut to its first `num_blocks` blocks (every weight trains)."""
    return dataclasses.replace(CACHED, num_blocks=num_blocks, full=True, lora_params=0)


@dataclass(frozen=True)
class RecordedPlan:
    workload: str
    sizes: Sizes
    measured: Measured
    budget_gb: float
    fixed: dict  # the config's explicit plan keys
    online: bool  # the config encodes online (data.cache "off")
    choice: Choice | None = None  # what the plan must choose
    peak_gb: float | None = None  # its predicted peak, to 0.01 GB
    refusal: str | None = None  # or the kind of NoFit it must answer
    needs_gb: float | None = None  # and what the smallest setting needs, to 0.1 GB


# The measurements of the 2509 workload (12,984 tokens) at each budget, from the cache.
CACHED_141 = Measured(
    act_bytes=1452693504,
    ckpt_bytes=80639744,
    transient_bytes=1339615232,
    fwd_s=0.0077525340000192955,
    fwd_bwd_s=0.021515326999974604,
    h2d_bytes_per_s=50843659540.624016,
    ckpt_transient_bytes=2708410368,
    kept_bytes=81020160,
    kept_recompute_s=0.004607176000035906,
)
CACHED_80 = Measured(
    act_bytes=1453050368,
    ckpt_bytes=80100096,
    transient_bytes=1338926080,
    fwd_s=0.007343388000094819,
    fwd_bwd_s=0.0212136489999466,
    h2d_bytes_per_s=54911586635.44657,
    ckpt_transient_bytes=2709882880,
    kept_bytes=81020160,
    kept_recompute_s=0.004303266999954758,
)
CACHED_24 = Measured(
    act_bytes=1453050368,
    ckpt_bytes=80100096,
    transient_bytes=1338926080,
    fwd_s=0.007317994999993971,
    fwd_bwd_s=0.02087673200003337,
    h2d_bytes_per_s=54454971646.69977,
    ckpt_transient_bytes=2709882880,
    kept_bytes=81020160,
    kept_recompute_s=0.005096646999845689,
)
CACHED_16 = Measured(
    act_bytes=1452693504,
    ckpt_bytes=80639744,
    transient_bytes=1339615232,
    fwd_s=0.007736198999992894,
    fwd_bwd_s=0.02161766400000431,
    h2d_bytes_per_s=54992345519.41806,
    ckpt_transient_bytes=2708410368,
    kept_bytes=81020160,
    kept_recompute_s=0.00541686399999719,
)
ONLINE_80 = Measured(
    act_bytes=1453050368,
    ckpt_bytes=80100096,
    transient_bytes=1338926080,
    fwd_s=0.00769119699998555,
    fwd_bwd_s=0.02256347400003733,
    h2d_bytes_per_s=54144831606.38967,
    encode_bytes=2212153856.0,
    ckpt_transient_bytes=2709882880,
    kept_bytes=81020160,
    kept_recompute_s=0.004515940999965551,
)
# The v1 workload encoding online at 48 GB. Its 24 GB run stopped before it recorded a
# measurement (nothing fit), so the 48 GB run's, on the same machine, stands in for it.
V1_ONLINE_48 = Measured(
    act_bytes=1099880960,
    ckpt_bytes=60512416,
    transient_bytes=844218368.0,
    fwd_s=0.004908198999942215,
    fwd_bwd_s=0.013834228999940024,
    h2d_bytes_per_s=54014918543.85737,
    encode_bytes=2212153856.0,
    ckpt_transient_bytes=1878305280,
    kept_bytes=61457760,
    kept_recompute_s=0.003950866000025144,
)
# A full fine-tune of 9 blocks at 80 GB, the 2509 workload from the cache.
FULL_80 = Measured(
    act_bytes=1520281088,
    ckpt_bytes=80542464,
    transient_bytes=630213120,
    fwd_s=0.007757813000011993,
    fwd_bwd_s=0.027093786999998315,
    h2d_bytes_per_s=55167432003.48575,
    ckpt_transient_bytes=2507188224,
    kept_bytes=81020160,
    kept_recompute_s=0.005753500000011513,
)

OFF = {"data.cache": "off"}
RECORDED = [
    # no checkpointing: everything resident, with the fp8 base's transposed copy
    RecordedPlan("2509 cached 141 GB", CACHED, CACHED_141, 141, {}, False, Choice(True, True, 0, 0, True), 129.31),
    # part of the blocks checkpointed and offloaded, every checkpointed block keeping its attention output
    RecordedPlan(
        "2509 cached 80 GB",
        CACHED,
        CACHED_80,
        80,
        {},
        False,
        Choice(True, False, 26, 26, True, kept_attention=26),
        74.00,
    ),
    # all but one block checkpointed and offloaded; the one resident block keeps its transposed copy
    RecordedPlan(
        "2509 cached 24 GB",
        CACHED,
        CACHED_24,
        24,
        {},
        False,
        Choice(True, True, 59, 59, True, kept_attention=59),
        20.38,
    ),
    # only DeepSpeed's optimizer offload fits; the room left keeps the attention of only some blocks
    RecordedPlan(
        "2509 cached 16 GB with the optimizer offload",
        CACHED,
        CACHED_16,
        16,
        {},
        False,
        Choice(True, True, 60, 60, True, offload_optimizer=True, kept_attention=46),
        13.70,
    ),
    # online, the encoders on the GPU and the next micro-batch encoding ahead
    RecordedPlan(
        "2509 online 80 GB",
        ONLINE,
        ONLINE_80,
        80,
        OFF,
        True,
        Choice(True, False, 38, 38, False, kept_attention=38),
        73.47,
    ),
    # v1 online, encoding ahead: the encoders beside nearly every block checkpointed and offloaded
    RecordedPlan(
        "v1 online 48 GB",
        ONLINE,
        V1_ONLINE_48,
        48,
        OFF,
        True,
        Choice(True, False, 53, 53, False, kept_attention=53),
        43.95,
    ),
    # data.cache "off" in the config: nothing fits, not even with every lever pulled
    RecordedPlan("v1 online 24 GB refused", ONLINE, V1_ONLINE_48, 24, OFF, True, refusal="budget", needs_gb=27.0),
    # the same run with data.cache left to the plan trains from the cache instead, with fewer blocks offloaded
    # than checkpointed
    RecordedPlan(
        "v1 online 24 GB, the cache left to the plan",
        ONLINE,
        V1_ONLINE_48,
        24,
        {},
        True,
        Choice(True, False, 56, 55, True, kept_attention=56),
        21.29,
    ),
    # the deepest full fine-tune the GPU alone fits: bf16, nothing checkpointed
    RecordedPlan(
        "full fine-tune 9 blocks 80 GB",
        full_fine_tune(9),
        FULL_80,
        80,
        {},
        False,
        Choice(False, False, 0, 0, True),
        68.98,
    ),
    # one block more needs DeepSpeed's optimizer offload
    RecordedPlan(
        "full fine-tune 10 blocks 80 GB with the optimizer offload",
        full_fine_tune(10),
        FULL_80,
        80,
        {},
        False,
        Choice(False, False, 0, 0, True, offload_optimizer=True),
        23.51,
    ),
]
