"""`harken bench overload` (lab/bench/overload.py): its bookkeeping and output contract at a tiny
scale (2 users, 3 s). No timing thresholds: the figures are the benchmark's business, not the tests'."""

from __future__ import annotations

import json

import pytest

from harken.cli import main
from harken.bench.overload import OverloadBenchOptions
from harken.bench.overload_clients import FLOOD_FRAMES, Knocks
from harken.shared.errors import HarkenError

RUN = ("p50_update_ms", "p95_update_ms", "errors", "events", "segments", "wall_s")


def test_knocks_summary():
    k = Knocks()
    assert k.summary() == {"tries": 0, "codes": {}, "p50_ms": None, "p95_ms": None, "max_ms": None}
    for code, ms in (("RESOURCE_EXHAUSTED", 2.0), ("RESOURCE_EXHAUSTED", 4.0), ("ADMITTED", 9.0)):
        k.add(code, ms)
    assert k.summary() == {"tries": 3, "codes": {"ADMITTED": 1, "RESOURCE_EXHAUSTED": 2}, "p50_ms": 4.0,
                           "p95_ms": 8.5, "max_ms": 9.0}
    with pytest.raises(HarkenError):
        OverloadBenchOptions(attacker_share=1)  # the flood and the idle stream need two sessions


def test_overload_refuses_the_second_m_and_the_attacker_pushes_no_one_out(capsys):
    assert main(["bench", "overload", "--sessions", "2", "--seconds", "3", "--rounds", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for kind in ("alone", "overload", "attacked"):
        assert set(RUN) <= set(r[kind]), kind
        assert r[kind]["errors"] == {} and r[kind]["segments"] >= 2 * 2, kind  # every user admitted, to its finals, twice
    assert "rejections" not in r["alone"]
    assert len(r["rounds"]) == 2  # interleaved rounds, each kind's latencies pooled over them
    assert all(rnd[f"p95_{kind}_ms"] > 0 for rnd in r["rounds"] for kind in ("alone", "overload", "attacked"))
    assert r["pushed_out"] == 0
    for key in ("p95_ratio_overload", "p95_ratio_attacked", "rejection_goal_ms"):
        assert key in r
    # the knocking users: refused with RESOURCE_EXHAUSTED (a try in flight as the first user ends
    # may find its slot free: ADMITTED)
    rejections = r["rejections"]
    assert rejections["tries"] >= 2 and set(rejections["codes"]) - {"ADMITTED"} == {"RESOURCE_EXHAUSTED"}
    assert 0 <= rejections["p50_ms"] <= rejections["p95_ms"] <= rejections["max_ms"]
    for kind in ("overload", "attacked"):
        assert r[kind]["rejections"]["codes"].get("RESOURCE_EXHAUSTED", 0) >= 1
    a = r["attacker"]
    assert a["over_claim_code"] == "INVALID_ARGUMENT" and a["over_claim_payload_bytes"] == 10
    assert a["flood_admitted"] and a["idle_admitted"]
    assert a["flood_state"] == "held" and a["idle_state"] == "held"
    assert a["extra_tries"] == {"RESOURCE_EXHAUSTED": 3}  # past the key's share
    # the server stopped reading the flood within one message of its session's queued-audio limit
    assert 0 < a["flood_max_queued_frames"] <= 100 * 60 + FLOOD_FRAMES
    assert a["flood_frames_applied"] > 0
