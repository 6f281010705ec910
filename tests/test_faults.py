"""Numerical fault injection: every fault is recovered (and recorded) or refused with a clear error."""
import pytest

from msrm_lab.reliability.faults import FAULTS, run_faults


@pytest.mark.parametrize("fault", FAULTS, ids=[f"{a}:{n}" for a, n, _ in FAULTS])
def test_fault_is_recovered_or_refused(fault):
    (rec,) = run_faults([fault])
    assert rec["outcome"] in ("recovered", "refused"), rec
    assert rec["detail"]
