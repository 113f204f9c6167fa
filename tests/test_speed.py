"""recommend's search time (issue #20): measure what is uncertain, no duplicate work, the donor
store from one index, and the anytime curve in the report."""

from __future__ import annotations

import pytest

from ttrank import donors


def test_the_donor_store_loads_from_one_index(donor_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    first = donors.DonorStore.load([donor_dir])
    index = donors.store_index_path([donor_dir])
    assert index.exists()
    # the next load reads the index alone: no log is parsed, nor any record's features computed
    monkeypatch.setattr(donors, "_cached_index", lambda *a: pytest.fail("a log was read"))
    monkeypatch.setattr(donors, "donor_features", lambda *a: pytest.fail("features recomputed"))
    again = donors.DonorStore.load([donor_dir])
    assert [r.id for r in again.records()] == [r.id for r in first.records()]
    assert [r.trace_json for r in again.records()] == [r.trace_json for r in first.records()]
    assert set(again.features_of_records()) == {r.id for r in first.records()}
    # the workload's TIR is parsed only when a transfer asks for it
    assert str(again.workloads[0].module()) == str(first.workloads[0].module())


def test_the_store_index_follows_the_logs(donor_dir, tmp_path):
    """A log that changes (a `donors add`, a retune) is a new index: stat, not content."""
    import shutil

    work = tmp_path / "tiny_resnet"
    shutil.copytree(donor_dir, work)
    before = donors.store_index_path([work])
    rec = next(p for p in work.iterdir() if p.name.startswith("database_tuning_record"))
    rec.write_bytes(rec.read_bytes())  # the same content, written again
    assert donors.store_index_path([work]) != before
    assert donors.store_index_path([work], top_k=3) != donors.store_index_path([work])
