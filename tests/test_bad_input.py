"""The bad-input catalogue: each case raises its documented error, naming the stream/key and the problem."""
import pytest

from msrm_lab.reliability import all_cases, run_catalogue

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}:{c.name}" for c in CASES])
def test_bad_input_raises_named_error(case):
    with pytest.raises(case.error, match=case.match):
        case.build()


def test_catalogue_runner_reports_every_case():
    records = run_catalogue(CASES)
    assert len(records) == len(CASES) >= 50
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]]
