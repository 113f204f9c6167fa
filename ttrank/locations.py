"""Where ttrank's data lives: the shipped donors, rankers and measurement tables.

One rule, read here only: ``$TTRANK_HOME`` when set, else the checkout this package runs from
(its ``datasets/`` beside ``ttrank/``). A wheel or ``pip install .`` ships only the code, so
outside a checkout the data comes from ``TTRANK_HOME`` (a checkout, or a copy of its
``datasets/`` and ``models/``). The user's own data (added donors, recommend's measurements,
caches) lives under :func:`ttrank.util.cache_dir` either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import TTRankError
from .util import cache_dir, environ

HOME_ENV = "TTRANK_HOME"
# the folder above the package: a checkout of the repository when it holds datasets/
CHECKOUT = Path(__file__).resolve().parent.parent


class DataHomeError(TTRankError):
    """Neither TTRANK_HOME nor a checkout says where the shipped data is."""


def data_home(required: bool = True) -> Path | None:
    """The folder holding ``datasets/`` and ``models/`` (see the module's rule)."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser()
    if (CHECKOUT / "datasets").is_dir():
        return CHECKOUT
    if required:
        raise DataHomeError(f"no ttrank data: {CHECKOUT} is not a checkout of the ttrank "
                            f"repository (no datasets/ there) and {HOME_ENV} is not set; set "
                            f"{HOME_ENV} to a folder holding datasets/ and models/ (a checkout)")
    return None


@contextlib.contextmanager
def using_home(path: str | Path) -> Iterator[Path]:
    """Run with ``path`` as the data home (``$TTRANK_HOME``), for this process and its children."""
    with environ(HOME_ENV, path):
        yield Path(path)


def _under(*parts: str, required: bool) -> Path | None:
    home = data_home(required)
    return home.joinpath(*parts) if home is not None else None


def shipped_donors(required: bool = False) -> Path | None:
    """``datasets/donors``: one MetaSchedule work_dir per donor network."""
    return _under("datasets", "donors", required=required)


def shipped_measurements(required: bool = False) -> Path | None:
    """``datasets/measurements``: the cross-measurement tables the ranker learns from."""
    return _under("datasets", "measurements", required=required)


def shipped_ranker() -> Path:
    """``models/ranker.json``: the default ranker (its cost model is beside it)."""
    return _under("models", "ranker.json", required=True)


def user_ranker() -> Path:
    """The ranker ``ttrank adapt`` trains with this machine's rows: preferred when present."""
    return cache_dir() / "models" / "ranker.json"


def portable(path: str | Path) -> str:
    """A path as metadata keeps it: relative to the data home when inside it."""
    path = Path(path).resolve()
    home = data_home(required=False)
    if home is not None and path.is_relative_to(home.resolve()):
        return str(path.relative_to(home.resolve()))
    return str(path)


def resolve(stored: str | Path) -> Path:
    """The inverse of :func:`portable`: a relative path is under the data home."""
    stored = Path(stored)
    home = data_home(required=False)
    return stored if stored.is_absolute() or home is None else home / stored
