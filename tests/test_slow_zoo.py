"""Long runs on full-size zoo networks with the shipped donors and ranker (pytest -m slow)."""

from __future__ import annotations

import json

import pytest

from ttrank.cli import main
from ttrank import locations

pytestmark = pytest.mark.slow


@pytest.mark.skipif(locations.data_home(required=False) is None
                    or not locations.shipped_ranker().exists() or not locations.shipped_donors().exists(),
                    reason="needs the shipped ranker (models/) and donors (datasets/donors/)")
def test_recommend_resnet18_leave_one_out(tmp_path):
    report = tmp_path / "r18.json"
    rc = main(["recommend", "zoo:resnet18", "--leave-one-out", "-o", str(tmp_path / "r18.so"),
               "--json", str(report), "--data-dir", str(tmp_path / "data"), "--no-progress"])
    assert rc == 0
    r = json.loads(report.read_text())
    assert r["max_abs_error_vs_onnxruntime"] < 1e-3
    assert all(k["chosen"] is None or k["chosen"]["donor_network"] != "resnet18" for k in r["kernels"])
    assert r["search_seconds"]["refitting_ranker"] > 0  # the ranker learned without resnet18's rows
    lat = r["model_latency_ms"]
    assert lat["tuned"] < lat["untuned"] / 5
