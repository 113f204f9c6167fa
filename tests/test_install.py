"""An installed copy (not editable: no datasets/ beside the package) finds the shipped data by
TTRANK_HOME, and says in one line what to do when nothing tells it where the data is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --no-deps --target``: the package as a wheel ships it, and nothing else."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # a copy, so the build's own folders stay out of the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ttrank", src / "ttrank", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                        "--target", str(site), str(src)], capture_output=True, text=True, timeout=600,
                       env=_pip_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (site / "datasets").exists() and (site / "bin" / "ttrank").exists()
    return site


def _pip_env() -> dict[str, str]:
    """This environment without CA-bundle variables that name a missing file: with one, pip
    refuses even a local index (seen on a machine whose /etc/ssl was gone)."""
    certs = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    return {k: v for k, v in os.environ.items() if not (k in certs and not os.path.exists(v))}


def _ttrank(site: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The installed console script, importing the installed copy alone."""
    base = {k: v for k, v in os.environ.items() if k not in ("TTRANK_HOME", "PYTHONPATH")}
    return subprocess.run([sys.executable, str(site / "bin" / "ttrank"), *args], cwd=cwd,
                          env={**base, "PYTHONPATH": str(site), "TTRANK_CACHE": str(cwd / "cache"), **env},
                          capture_output=True, text=True, timeout=600)


def test_an_installed_copy_reads_the_data_home_it_is_given(installed, donor_dir, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(donor_dir, home / "datasets" / "donors" / "tiny_resnet")
    r = _ttrank(installed, tmp_path, "donors", "list", "--json", TTRANK_HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert '"network": "tiny_resnet"' in r.stdout
    where = subprocess.run([sys.executable, "-c", "import ttrank.locations as l; print(l.__file__)"],
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(installed)},
                           capture_output=True, text=True, timeout=600)
    assert where.stdout.strip().startswith(str(installed))  # not the checkout's copy


def test_an_installed_copy_without_data_says_where_to_put_it(installed, tmp_path):
    r = _ttrank(installed, tmp_path, "donors", "list")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ttrank: error: no ttrank data")
    assert "TTRANK_HOME" in r.stderr and "checkout" in r.stderr
