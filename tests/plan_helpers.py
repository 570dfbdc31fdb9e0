"""What the memory plan's tests share: block figures of the measured shape, and the plan as a run takes it."""

from __future__ import annotations

from train.config import LoraConfig
from train.model import family
from train.plan.choice import choose
from train.plan.explain import choice_or_refusal
from train.plan.host import UNCOUNTED_HOST, Host
from train.plan.measure import Measured
from train.plan.sizes import GB, Sizes

# qwen_edit.lora as a run on a Qwen-Image model resolves its default (the family's targets)
QWEN_LORA = LoraConfig(target_modules=list(family.family_named("qwen_image").lora.targets))


def measured(tokens: int) -> Measured:
    """Block figures of the shape the GPU measurement gives, scaled linearly with the micro-batch's tokens
    (at 12.5k tokens: 1.5 GB kept per plain block, its two input streams per checkpointed one)."""
    scale = tokens / 12_500
    return Measured(
        act_bytes=1.5 * GB * scale,
        ckpt_bytes=tokens * 3072 * 2 * 2,
        transient_bytes=5 * GB * scale,
        fwd_s=0.0075 * scale,
        fwd_bwd_s=0.0235 * scale,
        h2d_bytes_per_s=25e9,
    )


def plan(
    s: Sizes,
    m: Measured,
    budget: float,
    margin: float,
    fixed: dict,
    fp8_ok: bool,
    online: bool,
    offload_blocker: str | None = None,
    host: Host = UNCOUNTED_HOST,
):
    """The setting the plan chooses and its prediction, or the PlanError a run stops with (choose, then its words)."""
    return choice_or_refusal(choose(s, m, budget, margin, fixed, fp8_ok, online, offload_blocker, host), s, host, fixed)
