"""A data home without one CPU: what a user of a CPU that the shipped data never saw gets.

Issue #19's "CPU never seen" targets can only be measured on a CPU the shipped data lacks. Once
one host run's rows and native sets are published, the same machine would be tested on its own
data. :func:`hold_out_cpu` builds a view of the data home (``datasets/`` and ``models/``, see
:mod:`ttrank.locations`) without anything measured or tuned on that CPU:

- donor sets tuned on it (their manifest's CPU, or any CPU a resumed run continued on) are left
  out; the others are linked, not copied;
- the measurement tables keep every other CPU's rows;
- the ranker is refitted on those rows with the shipped ranker's settings
  (:func:`ttrank.training.train` ``like=``), when it had learned the CPU; the CPU does not
  blend in its family's ranker, which its own rows chose;
- ``bench/`` is linked: benchmarks run with the view still write to the checkout.

Point ``TTRANK_HOME`` at :attr:`HeldOut.home` (:func:`ttrank.locations.using_home`) and every
command sees the view. The view is rebuilt only when the shipped data changes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import locations, training
from .donors import DonorStore, write_store_manifest
from .errors import TTRankError
from .ranker import Ranker
from .util import atomic_write_json, atomic_write_text, current_umask, file_lock, read_jsonl
from .workdir import MANIFEST_FILE, read_manifest

# in the view's root: what was held out, and of which source
RECORD = "held_out.json"
VERSION = 1


@dataclass
class HeldOut:
    """A data home without ``mcpu``: where it is and what it left out."""

    home: Path
    mcpu: str
    source: str  # the data home it was built from
    fingerprint: str  # of the source's files: the view is rebuilt when it changes
    sets: list[str] = field(default_factory=list)  # donor sets left out
    rows: int = 0  # measurement rows left out
    rows_kept: int = 0
    retrained: bool = False  # the ranker had learned the CPU: refitted without its rows

    def to_json(self) -> dict:
        return {**asdict(self), "home": str(self.home), "version": VERSION}


def tuned_on(work_dir: Path, mcpu: str) -> bool:
    """Whether a donor set's records were searched on ``mcpu`` (in part, for a resumed run)."""
    m = read_manifest(work_dir)
    return (m.get("provenance") or {}).get("mcpu") == mcpu or mcpu in (m.get("cpus") or [])


def row_cpu(r: dict) -> str | None:
    """The CPU a measurement row was measured on."""
    return (r.get("provenance") or {}).get("mcpu")


def fingerprint(source: Path, mcpu: str, like: Ranker | None = None) -> str:
    """The source data's files by path, size and mtime (stat only: no log is read), and the
    configuration ``like`` the ranker is refitted with, if one is given."""
    h = hashlib.sha256(f"v{VERSION} {mcpu}".encode())
    if like is not None:
        h.update(json.dumps([like.get_params(), training.own_spec(like)], sort_keys=True, default=str).encode())
    for sub in ("datasets/measurements", "datasets/donors", "models"):
        root = source / sub
        if not root.exists():
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file():
                st = p.stat()
                h.update(f"\n{p.relative_to(source)} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def hold_out_cpu(mcpu: str, dest: str | Path, source: str | Path | None = None,
                 like: Ranker | None = None) -> HeldOut:
    """The data home ``source`` (default: the shipped one) without ``mcpu``, built at ``dest``.
    ``like``: the configuration to refit the ranker with (default: the source's ranker's).

    An existing view of the same source data is reused; otherwise it is built beside ``dest``
    and moved into place, so a killed run never leaves half a view behind.
    """
    source = Path(source) if source is not None else locations.data_home()
    source = source.resolve()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(source, mcpu, like)
    with file_lock(dest.with_name(dest.name + ".lock")):
        old = _read_record(dest)
        if old is not None and old.fingerprint == fp and old.mcpu == mcpu:
            return old
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 would outlive the move
        try:
            held = _build(mcpu, source, tmp, fp, like)
            atomic_write_json(tmp / RECORD, held.to_json())
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    held.home = dest
    return held


def _read_record(dest: Path) -> HeldOut | None:
    try:
        d = json.loads((dest / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if d.pop("version", None) != VERSION:
        return None
    return HeldOut(**{**d, "home": dest})


def _build(mcpu: str, source: Path, out: Path, fp: str, like: Ranker | None) -> HeldOut:
    held = HeldOut(out, mcpu, str(source), fp)
    datasets = source / "datasets"
    if not datasets.is_dir():
        raise TTRankError(f"{source}: no datasets/ to hold {mcpu} out of")
    (out / "datasets").mkdir(parents=True)
    for child in sorted(datasets.iterdir()):
        if child.name == "donors":
            held.sets = _donors_without(child, out / "datasets" / "donors", mcpu)
        elif child.name == "measurements":
            held.rows, held.rows_kept = _tables_without(child, out / "datasets" / "measurements", mcpu)
        else:
            (out / "datasets" / child.name).symlink_to(child)
    shutil.copytree(source / "models", out / "models")
    if (source / "bench").is_dir():  # benchmarks write their results and work there
        (out / "bench").symlink_to(source / "bench")
    ranker_path = out / "models" / "ranker.json"
    learned = mcpu in (Ranker.load(ranker_path).metadata.get("data_cpus") or {})
    if learned or held.sets:
        like = like or Ranker.load(source / "models" / "ranker.json")
        own = like.metadata.get("own")
        if own and mcpu in (own.get("family_for") or []):
            # whether its family's ranker helps it was chosen on its rows: a CPU never seen has no say
            like = copy.copy(like)  # the caller's stays as it is
            like.metadata = {**like.metadata, "own": {**own, "family_for": [c for c in own["family_for"] if c != mcpu]}}
        # refit on the rows left, with the donors left (a row's features need its donor)
        with locations.using_home(out):
            training.train([out / "datasets" / "measurements"],
                           DonorStore.load(sorted(p for p in (out / "datasets" / "donors").iterdir()
                                                  if p.is_dir())),
                           out=ranker_path, like=like)
        held.retrained = True
    return held


def _donors_without(src: Path, dst: Path, mcpu: str) -> list[str]:
    dst.mkdir(parents=True)
    dropped = []
    for d in sorted(src.iterdir()):
        if d.is_dir() and (d / MANIFEST_FILE).exists() and tuned_on(d, mcpu):
            dropped.append(d.name)
        elif d.is_dir():
            (dst / d.name).symlink_to(d)
    write_store_manifest(dst)
    return dropped


def _tables_without(src: Path, dst: Path, mcpu: str) -> tuple[int, int]:
    dst.mkdir(parents=True)
    dropped = kept = 0
    for p in sorted(src.iterdir()):
        if p.suffix != ".jsonl":
            (dst / p.name).symlink_to(p)
            continue
        rows = [r for r in read_jsonl(p)]
        keep = [r for r in rows if row_cpu(r) != mcpu]
        dropped += len(rows) - len(keep)
        kept += len(keep)
        atomic_write_text(dst / p.name, "".join(json.dumps(r) + "\n" for r in keep))
    return dropped, kept
