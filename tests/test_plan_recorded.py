"""The plan on recorded workloads (tests/recorded_plans.py): from what each run measured, the setting it must choose
and its predicted peak, or the refusal it must make."""

from __future__ import annotations

import pytest
from recorded_plans import RECORDED, RecordedPlan

from train.plan.choice import NoFit, choose
from train.plan.run_plan import gpu_margin
from train.plan.sizes import GB


@pytest.mark.parametrize("recorded", RECORDED, ids=[r.workload for r in RECORDED])
def test_the_plan_of_a_recorded_workload(recorded: RecordedPlan):
    budget = recorded.budget_gb * GB
    result = choose(
        recorded.sizes, recorded.measured, budget, gpu_margin(0, budget), recorded.fixed, True, recorded.online
    )
    if recorded.refusal is not None:
        assert isinstance(result, NoFit), result
        assert (result.kind, round(result.needs_bytes / GB, 1)) == (recorded.refusal, recorded.needs_gb)
        return
    assert not isinstance(result, NoFit), result
    choice, pred = result
    assert (choice, round(pred.peak_bytes / GB, 2)) == (recorded.choice, recorded.peak_gb)
