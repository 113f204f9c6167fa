"""A ranker that knows the CPU (issue #19): CPU facts in the features, rankers from before the
CPU group still usable, and evaluation per CPU and leave one CPU out."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from tvm import te

from ttrank import collect, donors, locations
from ttrank.cli import main
from ttrank.collect import Dataset
from ttrank.errors import RankerError
from ttrank.evaluate import leave_one_cpu_out, per_cpu
from ttrank.features import CPU_NAMES, FEATURE_NAMES, cpu_features
from ttrank.holdout import hold_out_cpu, row_cpu, tuned_on
from ttrank.layouts import simd_lanes
from ttrank.ranker import Ranker, meta_path
from ttrank.target import (cpu_busy_now, cpu_description, host_cores, host_mattr, host_mcpu, host_triple, make_target,
                           provenance, target_isa)
from ttrank.templates import accumulators
from ttrank.util import read_jsonl


def test_cpu_facts_come_from_llvm_for_any_cpu_name(capfd):
    zen5 = cpu_description({"mcpu": "znver5", "cores": 2, "threads": 2})
    assert zen5["amd"] == 1 and zen5["avx512"] == 1 and zen5["vector_bits"] == 512 and zen5["amx"] == 0
    # an RPC device reports its own triple: an Arm core with SVE, 128-bit NEON
    arm = cpu_description({"mcpu": "neoverse-v1", "device_key": "pi", "device_triple": "aarch64-linux-gnu",
                           "threads": 4})
    assert arm["arm"] == 1 and arm["sve"] == 1 and arm["vector_bits"] == 128
    # a row from another host names no triple: the CPU name is enough
    assert cpu_description({"mcpu": "neoverse-v1"})["arm"] == 1
    # a name LLVM does not know: no ISA facts, and nothing printed
    odd = cpu_description({"mcpu": "no-such-cpu", "threads": 2})
    assert "vector_bits" not in odd and odd["threads"] == 2
    assert "Error" not in capfd.readouterr().err
    f = cpu_features(odd, {}, 3.0)
    assert math.isnan(f["c_vector_bits"]) and f["c_threads"] == 2.0  # unknown facts are missing


def test_the_host_is_described_with_its_caches():
    me = cpu_description(provenance())
    assert me["mcpu"] == host_mcpu() and me["threads"] >= 1 and me["vector_bits"] >= 128
    f = cpu_features(me, {"mcpu": me["mcpu"], "threads": 1}, 4.0)  # a 16-wide loop, tuned here
    assert f["c_same_cpu"] == 1.0
    assert f["c_donor_threads"] == -math.log2(me["threads"])
    assert f["c_vec_lanes"] == 4.0 - math.log2(me["vector_bits"] / 32)
    assert list(f) == CPU_NAMES and FEATURE_NAMES[-len(CPU_NAMES):] == CPU_NAMES


AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})


@pytest.mark.skipif(not host_triple().startswith("x86_64"), reason="x86 feature flags")
def test_a_target_named_without_its_core_count_runs_on_this_hosts_cores():
    assert int(make_target("llvm -mcpu=znver1").attrs["num-cores"]) == host_cores()
    assert int(make_target("llvm -mcpu=znver1 -num-cores=1").attrs["num-cores"]) == 1


def test_the_host_target_fits_the_features_the_cpu_reports():
    # a hypervisor that hides AVX-512 behind a Zen 4's model: the code must not use it
    mattr = host_mattr("znver4", AVX2_FLAGS)
    assert "-avx512f" in mattr and not [m for m in mattr if m.startswith("+")]
    t = make_target({"kind": "llvm", "mcpu": "znver4", "mattr": mattr})
    assert target_isa(t)["avx512"] == 0 and target_isa(t)["vector_bits"] == 256
    # so the packed layout and the templates size for AVX2, and so do the ranker's CPU facts
    assert simd_lanes(t) == 8 and accumulators(t, 8) == 12
    assert cpu_description({"mcpu": "znver4", "target": str(t)})["avx512"] == 0
    # an LLVM older than the CPU names an older model: the features it has are switched on
    assert host_mattr("znver2", AVX2_FLAGS | {"avx512f", "avx512bw", "amx_tile"}) == ["+avx512f", "+avx512bw"]
    assert host_mattr("znver3", AVX2_FLAGS) == [] and host_mattr("znver3", frozenset()) == []
    # what runs here: the name LLVM gives this host, fitted to its flags, compiles and runs
    host = make_target()
    assert host_mattr(str(host.attrs["mcpu"])) == list(host.attrs.get("mattr") or [])
    x = np.arange(64, dtype="float32")
    for target in (host, make_target({"kind": "llvm", "mcpu": "x86-64", "mattr": host_mattr("x86-64")})):
        lib = tvm.compile(_scaled_add(), target=target)
        out = tvm.runtime.tensor(np.zeros(64, "float32"))
        lib["main"](tvm.runtime.tensor(x), out)
        np.testing.assert_allclose(out.numpy(), 2 * x + 1)


def _scaled_add() -> tvm.IRModule:
    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: a[i] * 2.0 + 1.0, name="b")
    return tvm.IRModule({"main": te.create_prim_func([a, b])})


def test_training_rows_carry_the_cpu_that_measured_them(measurements, donor_dir):
    ds = collect.build_dataset([measurements], donors.DonorStore.load([donor_dir]))
    col = {n: i for i, n in enumerate(FEATURE_NAMES)}
    me = cpu_description(provenance())
    assert np.all(ds.X[:, col["c_vector_bits"]] == me["vector_bits"])
    assert np.all(ds.X[:, col["c_same_cpu"]] == 1.0)  # the donor was tuned on this host too


def test_a_ranker_from_before_the_cpu_features_still_loads(measurements, donor_dir, tmp_path):
    ds = collect.build_dataset([measurements], donors.DonorStore.load([donor_dir]))
    old = Ranker(n_estimators=10, feature_groups=("t", "d", "s", "a", "r")).fit(ds.X, ds.y, ds.groups)
    path = old.save(tmp_path / "old.json")
    meta = json.loads(meta_path(path).read_text())
    # what a ranker saved before the CPU group existed lists
    meta["feature_names"] = [n for n in meta["feature_names"] if n not in CPU_NAMES]
    meta_path(path).write_text(json.dumps(meta))
    assert np.allclose(Ranker.load(path).predict(ds.X), old.predict(ds.X))
    # a schema whose existing names changed is refused
    meta["feature_names"][3] = "t_something_else"
    meta_path(path).write_text(json.dumps(meta))
    with pytest.raises(RankerError, match="feature schema"):
        Ranker.load(path)


def _two_cpu_dataset(n_groups: int = 40, size: int = 6) -> Dataset:
    """Synthetic candidates on an Intel and an AMD CPU: which schedule wins depends on the
    CPU's vector width against the schedule's vector loop, as on real hardware."""
    rng = np.random.default_rng(0)
    col = {n: i for i, n in enumerate(FEATURE_NAMES)}
    X, y, groups, meta = [], [], [], []
    for g in range(n_groups):
        amd = g % 2
        bits = 256 if amd else 512
        for _ in range(size):
            x = rng.random(len(FEATURE_NAMES)).astype(np.float32)
            vec = rng.integers(2, 6)
            x[col["a_vec_extent"]] = vec
            x[col["c_vector_bits"]], x[col["c_amd"]] = bits, amd
            x[col["c_vec_lanes"]] = vec - math.log2(bits / 32)
            lat = float(1e-3 * (1 + abs(x[col["c_vec_lanes"]]) + 0.1 * rng.random()))
            X.append(x)
            meta.append({"network": f"net{g % 5}", "workload": f"w{g}", "latency_s": lat, "weight": 1,
                         "mcpu": "znver4" if amd else "emeraldrapids"})
        lats = [m["latency_s"] for m in meta[-size:]]
        y += [min(lats) / v for v in lats]
        groups.append(size)
    return Dataset(np.asarray(X), np.asarray(y, dtype=np.float32), groups, meta)


def test_evaluation_per_cpu_and_leave_one_cpu_out():
    ds = _two_cpu_dataset()

    def make():
        return Ranker(objective="rank:pairwise", n_estimators=30)

    each = per_cpu(ds, make)
    assert set(each) == {"emeraldrapids", "znver4"} and all(r["average"]["top1"] > 0 for r in each.values())
    out = leave_one_cpu_out(ds, make)
    assert set(out["cpus"]) == {"emeraldrapids", "znver4"}
    assert 0 < out["average"]["top1"] <= out["average"]["top3"] <= 1.0
    # one CPU only: nothing to hold out, and the report says what it has
    one = leave_one_cpu_out(Dataset(ds.X[:6], ds.y[:6], [6], ds.meta[:6]), make)
    assert one["cpus"] == {} and one["have"] == ["emeraldrapids"]


def test_pooled_per_cpu_evaluation_trains_on_every_cpu_but_never_on_the_held_out_network():
    class NetworkSpy:  # defined here, so that the evaluation's worker processes get it by value
        """Fails if it is asked to score a network it was trained on (column 0: the network)."""

        def fit(self, X, y, groups):
            self.seen = set(X[:, 0].tolist())
            return self

        def predict(self, X):
            assert not self.seen & set(X[:, 0].tolist()), "scored a network it trained on"
            return -X[:, 1]

    ds = _two_cpu_dataset()
    X = ds.X.copy()
    X[:, 0] = [int(m["network"][3:]) for m in ds.meta]
    ds = Dataset(X, ds.y, ds.groups, ds.meta)
    each = per_cpu(ds, NetworkSpy, pooled=True)
    assert set(each) == {"emeraldrapids", "znver4"}
    assert all(set(r["networks"]) == {f"net{i}" for i in range(5)} for r in each.values())
    assert each["znver4"]["rows"] == each["emeraldrapids"]["rows"] == len(ds.y) // 2
    # a learned model pooled over both CPUs, with the CPU features, ranks each CPU's kernels
    learned = per_cpu(ds, lambda: Ranker(objective="rank:pairwise", n_estimators=30), pooled=True)
    assert all(0 < r["average"]["top1"] <= r["average"]["top3"] <= 1.0 for r in learned.values())


def test_another_machines_rows_join_the_training_data_once(measurements, donor_dir, tmp_path, capsys):
    from ttrank.cli import main
    from ttrank.util import append_jsonl, read_jsonl

    # the same tables as measured on another CPU (as `adapt` leaves them in its cache)
    other = "znver3" if host_mcpu() == "znver4" else "znver4"
    theirs = tmp_path / "theirs"
    (theirs / "kernels").mkdir(parents=True)
    for table in measurements.glob("*.jsonl"):
        rows = list(read_jsonl(table))
        for r in rows:
            r["provenance"] = {**r["provenance"], "mcpu": other, "cpu": "AMD EPYC"}
        append_jsonl(theirs / table.name, rows)
        (theirs / "kernels" / f"{table.stem}.json").write_text(
            (measurements / "kernels" / f"{table.stem}.json").read_text())
    ours = tmp_path / "ours"
    (ours / "kernels").mkdir(parents=True)
    for f in [*measurements.glob("*.jsonl"), *(measurements / "kernels").glob("*.json")]:
        (ours / f.relative_to(measurements)).write_text(f.read_text())
    store = donors.DonorStore.load([donor_dir])
    before = collect.build_dataset([ours], store)

    assert main(["import-measurements", str(theirs), "--out", str(ours)]) == 0
    assert main(["import-measurements", str(theirs), "--out", str(ours)]) == 0  # a repeat adds nothing
    assert "0 rows from" in capsys.readouterr().out.splitlines()[-1]
    after = collect.build_dataset([ours], store)
    # every kernel group again, for the other CPU; our own rows are as they were
    assert len(after.groups) == 2 * len(before.groups)
    assert sorted({m["mcpu"] for m in after.meta}) == sorted({host_mcpu(), other})
    # a folder without tables is one clear error
    assert main(["import-measurements", str(tmp_path / "nothing"), "--out", str(ours)]) != 0


def test_adapt_refits_the_ranker_it_has_with_the_configuration_chosen_for_it(measurements, donor_dir, trained,
                                                                            tmp_path):
    from ttrank.training import train

    like = Ranker.load(trained)
    like.max_depth = 3  # as if fitted by an older ttrank, whose trees were shallower
    rep = train([measurements], donors.DonorStore.load([donor_dir]), out=tmp_path / "ranker.json",
                like=like)
    new = Ranker.load(tmp_path / "ranker.json")
    # the configuration chosen for it, learned again from the rows there are now, without
    # choosing it again; the trees' other settings are this ttrank's
    chosen = ("objective", "feature_groups", "n_estimators")
    assert [getattr(new, k) for k in chosen] == [getattr(like, k) for k in chosen]
    assert new.max_depth == Ranker().max_depth and rep["leave_one_network_out"] is None
    assert new.metadata["top_k"] == rep["top_k"] and new.metadata["training_rows"] > 0


def test_the_ranker_settings_are_chosen_by_their_mean_over_the_cpus():
    from ttrank.training import candidate_configs, config_label, select_config

    ds = _two_cpu_dataset()
    configs = [c for c in candidate_configs(("reg:squarederror",))]
    best, results = select_config(ds, configs, n_estimators=20, seeds=(0,))
    assert all(set(r["cpus"]) == {"emeraldrapids", "znver4"} for r in results.values())

    def mean_over_cpus(label: str) -> float:
        return float(np.mean([(a["top1"] + a["top3"]) / 2 for a in results[label]["cpus"].values()]))

    assert config_label(best) == max(results, key=mean_over_cpus)


def test_a_refit_on_rows_of_avx2_and_avx512_cpus_learns_the_cpu_features(tmp_path):
    from ttrank.training import train

    ds = _two_cpu_dataset()  # emeraldrapids and znver4: both AVX-512
    like = Ranker(objective="reg:squarederror", n_estimators=20, feature_groups=("t", "d", "s", "a", "r"))
    like = Ranker.load(like.fit(ds.X, ds.y, ds.groups).save(tmp_path / "like.json", top_k=3))
    train([tmp_path], out=tmp_path / "same.json", ds=ds, like=like, programs=False)
    assert Ranker.load(tmp_path / "same.json").feature_groups == like.feature_groups
    # the AMD rows measured on an AVX2 CPU instead: the two classes' labels need the CPU told apart
    meta = [{**m, "mcpu": "znver1" if m["mcpu"] == "znver4" else m["mcpu"]} for m in ds.meta]
    train([tmp_path], out=tmp_path / "mixed.json", ds=Dataset(ds.X, ds.y, ds.groups, meta), like=like,
          programs=False)
    assert Ranker.load(tmp_path / "mixed.json").feature_groups == (*like.feature_groups, "c")


def test_collect_measures_donors_tuned_on_other_cpus(donor_dir, tmp_path):
    """A new CPU has no donor tuned on it: collect measures the donors of every CPU on it (as
    recommend ranks them), so the ranker learns how they fare there."""
    elsewhere = tmp_path / "tiny_resnet@skylake"
    shutil.copytree(donor_dir, elsewhere)
    records = elsewhere / "database_tuning_record.json"
    lines = []
    for line in records.read_text().splitlines():
        wl, (trace, secs, tgt, args) = json.loads(line)
        lines.append(json.dumps([wl, [trace, secs, {**tgt, "mcpu": "skylake-avx512"}, args]]))
    records.write_text("\n".join(lines) + "\n")
    cmd = ["collect", "tiny_cnn", "--donors", str(elsewhere), "--max-per-kernel", "1", "--repeat", "1",
           "--rounds", "1", "--no-paper", "--quiet"]
    assert main([*cmd, "--out", str(tmp_path / "all")]) == 0
    rows = [json.loads(l) for l in (tmp_path / "all" / "tiny_cnn.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["record"] != collect.UNTUNED]
    assert measured and all(r["record"].startswith("tiny_resnet@skylake/") for r in measured)
    # the old behaviour on request: only this very target's donors (none here)
    assert main([*cmd, "--out", str(tmp_path / "same"), "--same-target-only"]) == 0
    rows = [json.loads(l) for l in (tmp_path / "same" / "tiny_cnn.jsonl").read_text().splitlines()]
    assert all(r["record"] == collect.UNTUNED for r in rows)


def test_busy_means_work_running_now_not_a_minute_ago():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        assert cpu_busy_now() >= 0.7  # one spinning process holds about one logical CPU
    finally:
        spin.kill()
        spin.wait()


def test_a_cpu_held_out_of_the_shipped_data_is_one_it_has_never_seen(tmp_path):
    """bench/host.py's "CPU never seen" on a machine whose rows were already published: the
    view of the data home leaves out its rows, its donor sets and the ranker's knowledge of it."""
    shipped = Ranker.load(locations.shipped_ranker())
    cpus = shipped.metadata.get("data_cpus") or {}
    if len(cpus) < 2:
        pytest.skip("the shipped ranker learned one CPU")
    mcpu = min(cpus, key=cpus.get)  # the CPU with the fewest rows: the quickest refit
    root = locations.shipped_donors(required=True)
    tuned_there = {d.name for d in root.iterdir() if d.is_dir() and tuned_on(d, mcpu)}

    # refitted with the shipped configuration but 10 rounds instead of 300: the view is the point
    like = Ranker(**{**shipped.get_params(), "n_estimators": 10})
    like.metadata["own"] = shipped.metadata.get("own")
    held = hold_out_cpu(mcpu, tmp_path / "home", like=like)
    assert set(held.sets) == tuned_there and held.retrained and held.rows > 0
    with locations.using_home(held.home):
        assert {d.name for d in donors.shipped_work_dirs()}.isdisjoint(tuned_there)
        rows = [r for p in locations.shipped_measurements().glob("*.jsonl") for r in read_jsonl(p)]
        assert len(rows) == held.rows_kept and all(row_cpu(r) != mcpu for r in rows)
        ranker = Ranker.load(locations.shipped_ranker())
        # refitted on the rows kept: every CPU the shipped ranker knew but the one held out, and
        # any whose rows were published after the shipped ranker's last fit
        learned = set(ranker.metadata["data_cpus"])
        assert mcpu not in learned and set(cpus) - {mcpu} <= learned <= {row_cpu(r) or "unknown" for r in rows}
        # nothing of it: not its own ranker, nor the choice of its family's, made on its rows
        assert ranker.n_estimators == 10 and mcpu not in ranker.own_cpus() + ranker.family_cpus()
        assert (locations.data_home() / "bench").resolve() == (locations.CHECKOUT / "bench").resolve()
    # the shipped data is untouched, and the view is reused while it does not change
    assert Ranker.load(locations.shipped_ranker()).metadata["data_cpus"] == cpus
    stamp = (held.home / "models" / "ranker.json").stat().st_mtime_ns
    assert hold_out_cpu(mcpu, tmp_path / "home", like=like).fingerprint == held.fingerprint
    assert (held.home / "models" / "ranker.json").stat().st_mtime_ns == stamp


def test_an_evaluated_refit_copies_the_configuration_and_chooses_the_rest_again(tmp_path):
    from ttrank.training import train

    ds = _two_cpu_dataset()
    like = Ranker(objective="reg:squarederror", n_estimators=20, feature_groups=("t", "d", "s", "a", "r", "c"))
    # a second stage and k chosen once, on other rows
    stale = {"enabled": True, "weight": 0.5, "shortlist": 5, "cost_model": "ranker.costmodel.json"}
    like = Ranker.load(like.fit(ds.X, ds.y, ds.groups).save(tmp_path / "like.json", top_k=5, stage2=stale))
    rep = train([tmp_path], out=tmp_path / "new.json", ds=ds, like=like, evaluate_like=True, programs=False)
    new = Ranker.load(tmp_path / "new.json")
    assert (new.objective, new.feature_groups, new.n_estimators) == (like.objective, like.feature_groups, 20)
    # its leave-one-network-out on these rows decided k and AdaptiveK's gap; no stage was carried over
    assert set(rep["configs"]) == {rep["config"]} and rep["leave_one_network_out"]["top1"] > 0
    assert new.metadata["policy"]["gap"] > 0 and new.metadata.get("stage2") is None
    assert rep["refit_like"]["model_sha256"] == like.metadata["model_sha256"]


def _own_cpu_dataset() -> Dataset:
    """Two CPUs' rows, 60 kernel groups each, and 12 groups of a third CPU measured on few rows."""
    ds = _two_cpu_dataset(n_groups=132)
    meta = [{**m, "mcpu": "znver5"} if i >= 120 * 6 else m for i, m in enumerate(ds.meta)]
    return Dataset(ds.X, ds.y, ds.groups, meta)


def test_a_cpu_with_rows_enough_gets_its_own_ranker_blended_into_the_pooled_one(tmp_path):
    ds = _own_cpu_dataset()
    cpus = np.array([m["mcpu"] for m in ds.meta])
    pooled = Ranker(objective="reg:squarederror", n_estimators=20).fit(ds.X, ds.y, ds.groups)
    plain = pooled.predict(ds.X)
    pooled.fit_own(ds.X, ds.y, ds.groups, cpus, min_rows=300, weight=0.5)
    pooled.save(tmp_path / "ranker.json")
    # znver5's 72 rows are too few for a ranker of its own
    assert sorted(p.name for p in tmp_path.glob("ranker.own-*.json") if ".meta" not in p.name) == [
        "ranker.own-emeraldrapids.json", "ranker.own-znver4.json"]

    r = Ranker.load(tmp_path / "ranker.json")
    assert r.own_cpus() == ["emeraldrapids", "znver4"]
    own = Ranker.load(tmp_path / "ranker.own-znver4.json")
    assert "c" not in own.feature_groups  # constant on one CPU's rows
    np.testing.assert_allclose(r.predict(ds.X, "znver4"), 0.5 * plain + 0.5 * own.predict(ds.X), rtol=1e-5)
    # a CPU without one, or none named: the pooled ranker alone
    np.testing.assert_allclose(r.predict(ds.X, "znver5"), plain)
    np.testing.assert_allclose(r.predict(ds.X), plain)

    # refitted where znver4's rows no longer say which CPU measured them: its file goes
    r.fit_own(ds.X, ds.y, ds.groups, np.where(cpus == "znver4", "unknown", cpus), min_rows=300)
    r.save(tmp_path / "ranker.json")
    assert not (tmp_path / "ranker.own-znver4.json").exists()
    assert Ranker.load(tmp_path / "ranker.json").own_cpus() == ["emeraldrapids"]


def test_a_cpu_family_ranker_is_blended_in_for_the_cpus_that_chose_it(tmp_path):
    """znver5's 72 rows are too few for a ranker of its own, but Zen 4 and Zen 5 are one family
    (AMD, AVX-512): a ranker of both CPUs' rows, with the CPU features, is blended in for the
    CPUs that chose it (training.evaluate_own chooses by leave-one-network-out)."""
    ds = _own_cpu_dataset()
    cpus = np.array([m["mcpu"] for m in ds.meta])
    r = Ranker(objective="reg:squarederror", n_estimators=20).fit(ds.X, ds.y, ds.groups)
    plain = r.predict(ds.X)
    r.fit_own(ds.X, ds.y, ds.groups, cpus, min_rows=300, family_for=["znver5", "emeraldrapids"])
    r.save(tmp_path / "ranker.json")
    # emeraldrapids is the only CPU of its family: its own ranker is all it has
    assert sorted(p.name for p in tmp_path.glob("ranker.own-*.json") if ".meta" not in p.name) == [
        "ranker.own-emeraldrapids.json", "ranker.own-x86-amd-512.json", "ranker.own-znver4.json"]
    r = Ranker.load(tmp_path / "ranker.json")
    assert r.family_cpus() == ["znver5"] and r.metadata["own"]["families"]["x86-amd-512"]["cpus"] == [
        "znver4", "znver5"]
    family = Ranker.load(tmp_path / "ranker.own-x86-amd-512.json")
    assert "c" in family.feature_groups  # its CPUs differ
    np.testing.assert_allclose(r.predict(ds.X, "znver5"), 0.5 * plain + 0.5 * family.predict(ds.X), rtol=1e-5)
    own = Ranker.load(tmp_path / "ranker.own-znver4.json")
    np.testing.assert_allclose(r.predict(ds.X, "znver4"), 0.5 * plain + 0.5 * own.predict(ds.X), rtol=1e-5)
    # a CPU of the family that never measured a row did not choose it: the pooled ranker alone
    np.testing.assert_allclose(r.predict(ds.X, "znver3"), plain)

    # a CPU with both: at weight 0.5 each, the three are averaged
    r.fit_own(ds.X, ds.y, ds.groups, cpus, min_rows=300, family_for=["znver4"])
    r.save(tmp_path / "ranker.json")
    r = Ranker.load(tmp_path / "ranker.json")
    own, family = (Ranker.load(tmp_path / f"ranker.own-{n}.json") for n in ("znver4", "x86-amd-512"))
    np.testing.assert_allclose(r.predict(ds.X, "znver4"), (plain + own.predict(ds.X) + family.predict(ds.X)) / 3,
                               rtol=1e-5)
    np.testing.assert_allclose(r.predict(ds.X, "znver5"), plain)


def test_an_own_ranker_from_another_fit_is_refused(tmp_path):
    ds = _own_cpu_dataset()
    cpus = np.array([m["mcpu"] for m in ds.meta])
    for name, seed in (("a", 0), ("b", 1)):
        Ranker(n_estimators=10, seed=seed).fit(ds.X, ds.y, ds.groups).fit_own(
            ds.X, ds.y, ds.groups, cpus, min_rows=300).save(tmp_path / f"{name}.json")
    shutil.copy(tmp_path / "b.own-znver4.json", tmp_path / "a.own-znver4.json")
    shutil.copy(tmp_path / "b.own-znver4.meta.json", tmp_path / "a.own-znver4.meta.json")
    a = Ranker.load(tmp_path / "a.json")
    a.predict(ds.X[:3], "emeraldrapids")
    with pytest.raises(RankerError, match="not the own model"):
        a.predict(ds.X[:3], "znver4")
    # copied elsewhere without its own models: the pooled ranker alone, and a warning
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "b.json", tmp_path / "elsewhere" / "b.json")
    shutil.copy(tmp_path / "b.meta.json", tmp_path / "elsewhere" / "b.meta.json")
    c = Ranker.load(tmp_path / "elsewhere" / "b.json")
    np.testing.assert_allclose(c.predict(ds.X[:3], "znver4"), c.predict(ds.X[:3]))


def test_training_blends_in_the_own_rankers_and_evaluates_them_per_cpu(tmp_path):
    from ttrank.training import train

    ds = _own_cpu_dataset()
    like = Ranker(objective="reg:squarederror", n_estimators=10)
    like.fit(ds.X, ds.y, ds.groups).metadata["own"] = {"min_rows": 300, "weight": 0.5, "cpus": {}}
    like = Ranker.load(like.save(tmp_path / "like.json", top_k=3))
    rep = train([tmp_path], out=tmp_path / "new.json", ds=ds, like=like, evaluate_like=True, programs=False)
    new = Ranker.load(tmp_path / "new.json")
    assert new.own_cpus() == ["emeraldrapids", "znver4"]
    # the leave-one-network-out evaluation is of what recommend ranks with: per CPU, the pooled
    # ranker alone and with its own blended in
    # ranker alone and with its own and its family's blended in; each CPU with a family ranker
    # (Zen 4 and 5 here) takes it where that helps it
    per = rep["own"]["per_cpu"]
    assert rep["own"]["families"] == ["x86-amd-512"] and set(rep["own"]["family_for"]) <= {"znver4", "znver5"}
    assert new.family_cpus() == rep["own"]["family_for"]
    for cpu, a in per.items():
        chose = a["family"]
        assert chose == (cpu in rep["own"]["family_for"])
        assert (a["top1"], a["top3"]) == ((a["top1_family"], a["top3_family"]) if chose else
                                          (a["top1_no_family"], a["top3_no_family"]))
        if chose:
            assert a["top1_family"] + a["top3_family"] > a["top1_no_family"] + a["top3_no_family"]
    assert per["znver5"]["own"] is False and per["znver5"]["top1_no_family"] == per["znver5"]["top1_pooled"]
    assert per["znver4"]["own"] is True and 0 < per["znver4"]["top1"] <= 1
    # a refit without evaluation (adapt's) keeps the rule and the choice
    train([tmp_path], out=tmp_path / "refit.json", ds=ds, like=new, programs=False)
    refit = Ranker.load(tmp_path / "refit.json")
    assert refit.own_cpus() == ["emeraldrapids", "znver4"] and refit.family_cpus() == new.family_cpus()


def test_ranking_for_a_cpu_with_its_own_ranker_blends_it_in(trained, measurements, donor_dir, tiny_cnn, target):
    import ttrank
    from ttrank.evaluate import cpu_of_rows

    store = donors.DonorStore.load([donor_dir])
    ds = collect.build_dataset([measurements], store)
    ranker = Ranker.load(trained)
    pooled = ttrank.rank(tiny_cnn, store=store, ranker=ranker, target=target, programs=False)
    # the tables were measured here: this CPU gets a ranker of its own rows
    ranker.fit_own(ds.X, ds.y, ds.groups, cpu_of_rows(ds), min_rows=1)
    assert ranker.own_cpus() == [host_mcpu()]
    blended = ttrank.rank(tiny_cnn, store=store, ranker=ranker, target=target, programs=False)
    own = ranker.own_ranker(host_mcpu())
    for name, cands in blended.items():
        before = {c.record.id: c.score for c in pooled[name]}
        for c in cands:
            assert c.score == pytest.approx(0.5 * before[c.record.id] + 0.5 * float(own.predict(c.row)[0]), rel=1e-5)
