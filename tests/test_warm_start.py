"""The warm-start benchmark's smoke profile end to end: two fresh processes on one new cache directory, the first
writes the compiled program, the second finds it, both reach the same value."""
from __future__ import annotations

import pytest

from msrm_lab.bench import warm_start


def test_warm_start_smoke_rows():
    rows = warm_start.warm_start_rows("smoke")
    by = {(r["metric"], r["params"].get("cache_state")): r for r in rows}
    assert all(r["notebook"] == "time_to_result" and r["experiment"] == "warm_start" for r in rows)
    assert by[("cache_entries", "cold")]["value"] >= 1  # the cold process wrote the cache
    assert by[("cache_entries", "warm")]["value"] == by[("cache_entries", "cold")]["value"]  # nothing new to write
    for state in ("cold", "warm"):
        r = by[("first_call_s", state)]
        assert r["status"] == "measured" and r["value"] > 0
        assert r["params"]["min_s"] <= r["value"] <= r["params"]["max_s"]
        assert r["params"]["backend_child"] == "cpu"
    assert by[("first_call_s", "warm")]["params"]["target_s"] == warm_start.TARGET_WARM_S
    assert by[("warm_over_cold", None)]["params"]["same_value"] is True


def test_warm_start_rejects_bad_arguments():
    with pytest.raises(ValueError, match="profile"):
        warm_start.warm_start_rows("huge")
    with pytest.raises(ValueError, match="repeats"):
        warm_start.warm_start_rows("smoke", repeats=0)
