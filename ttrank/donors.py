"""Donor schedules: MetaSchedule JSONDatabase work_dirs, indexed by workload class."""

from __future__ import annotations

from pathlib import Path

from .errors import StoreError


def open_database(work_dir: str | Path):
    """Open a MetaSchedule JSONDatabase work_dir (read-only use)."""
    from tvm.s_tir import meta_schedule as ms

    work_dir = Path(work_dir)
    wl, rec = work_dir / "database_workload.json", work_dir / "database_tuning_record.json"
    if not wl.exists() or not rec.exists():
        raise StoreError(f"{work_dir}: not a MetaSchedule work_dir (needs {wl.name} and {rec.name})")
    return ms.database.JSONDatabase(path_workload=str(wl), path_tuning_record=str(rec),
                                    allow_missing=False)
