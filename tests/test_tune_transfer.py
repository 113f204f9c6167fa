"""Tuning, the donor store, transfer and measurement, on tiny models with a few trials."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm_ffi

from ttrank import donors, frontend, kernels, measure, measurements, transfer, util, zoo
from ttrank.cli import main
from ttrank.target import make_target
from ttrank.tune import count_trials, tune
from ttrank.workdir import (RECORD_FILE, TRIALS_FILE, WORKLOAD_FILE, loaded_as, merge_work_dir, open_database,
                            write_loaded_as)

from conftest import DONOR_KERNELS


def test_tune_writes_a_standard_database_and_trial_log(donor_dir):
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.JSONDatabase(work_dir=str(donor_dir))
    assert len(db.get_all_tuning_records()) >= 3 * 6 - 2
    counts = count_trials(donor_dir)
    assert set(counts) == set(DONOR_KERNELS)
    assert all(c["done"] >= 1 and c["best_s"] for c in counts.values())
    rows = [json.loads(l) for l in (donor_dir / "trials.jsonl").read_text().splitlines()]
    times = [r["search_s"] for r in rows if "latency_s" in r]
    assert times == sorted(times)  # cumulative search time: a convergence curve
    manifest = json.loads((donor_dir / "tune_manifest.json").read_text())
    assert manifest["complete"] and manifest["provenance"]["cpu"] and manifest["provenance"]["tvm"]


def test_rerun_of_a_finished_tune_does_no_work(donor_dir):
    before = (donor_dir / "database_tuning_record.json").read_bytes()
    assert main(["tune", "zoo:tiny_resnet", "--out", str(donor_dir), "--trials-per-task", "6",
                 "--only", *DONOR_KERNELS, "--no-progress"]) == 0
    assert (donor_dir / "database_tuning_record.json").read_bytes() == before


def test_kill_9_then_resume(tmp_path):
    out = tmp_path / "killed"
    # the classifier's matmul, a tiny share of the FLOPs, gets only the --small-trials
    cmd = [sys.executable, "-m", "ttrank.cli", "tune", "zoo:tiny_cnn", "--out", str(out),
           "--trials-per-task", "4", "--small-trials", "2", "--only", "fused_conv2d1_add_relu",
           "fused_matmul", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    log = out / "trials.jsonl"
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 1):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert log.exists(), "no trial was logged before the kill"
    # a torn line, as a kill in the middle of a write leaves it
    with open(out / "database_tuning_record.json", "ab") as f:
        f.write(b'[0, [[["GetSBlock"')
    assert subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
    assert (out / "database_tuning_record.json.torn").exists()
    counts = count_trials(out)
    manifest = json.loads((out / "tune_manifest.json").read_text())
    assert counts["fused_conv2d1_add_relu"]["done"] >= 4 or manifest["complete"]
    assert {t["name"]: t["target_trials"] for t in manifest["tasks"]} == \
        {"fused_conv2d1_add_relu": 4, "fused_matmul_add4": 2}
    store = donors.DonorStore.load([out], use_cache=False)
    assert store.records() and not store.reports[0].skipped.get("malformed line")


def test_ctrl_c_says_interrupted_and_resumes(tmp_path):
    out = tmp_path / "interrupted"
    # three tasks of one batch each: the first task's rows are logged while two more are left
    # (with one left, a fast machine could finish the run between the poll and the signal)
    cmd = [sys.executable, "-m", "ttrank.cli", "tune", "zoo:tiny_cnn", "--out", str(out),
           "--trials-per-task", "4", "--only", "fused_conv2d1_add_relu", "fused_conv2d_add_relu",
           "fused_matmul", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    log = out / "trials.jsonl"
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 1):
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    # what Ctrl-C sends to the terminal's process group (before, it could crash the process
    # inside MetaSchedule's native loop)
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.time()
    err = proc.communicate(timeout=120)[1]
    # when it fails: did the run end on its own before the signal, or ignore it?
    assert proc.returncode == 130, (err, sent, log.read_text()[-400:])
    # (inside MetaSchedule's loop it first says "stopping after the current batch")
    assert "interrupted; finished work is kept" in err and "internal error" not in err
    assert subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
    assert json.loads((out / "tune_manifest.json").read_text())["complete"]


def test_a_ctrl_c_that_native_code_swallowed_still_stops_the_next_task(tmp_path):
    """TVM turns a KeyboardInterrupt raised inside a native call into an error that MetaSchedule
    may swallow (a failed candidate): the request itself is kept, and tune stops before the
    next task."""
    try:
        with pytest.raises(KeyboardInterrupt):  # outside a safe section: raised as usual
            util.on_sigint(signal.SIGINT, None)
        assert util.STOP_REQUESTED.is_set()  # ... and recorded
        with pytest.raises(KeyboardInterrupt):
            tune(zoo.load("zoo:tiny_cnn").mod, tmp_path / "stopped", trials_per_task=2)
        assert count_trials(tmp_path / "stopped") == {}
    finally:
        util.STOP_REQUESTED.clear()


def test_a_second_ctrl_c_inside_a_safe_section_ends_the_process_at_once():
    """The first Ctrl-C asks to stop at the next safe point; the second ends the process with
    130 without unwinding (a KeyboardInterrupt raised inside TVM's worker pools could leave one
    of them hung on its lock)."""
    code = ("import signal\n"
            "from ttrank import util\n"
            "with util.stop_at_safe_points():\n"
            "    util.on_sigint(signal.SIGINT, None)\n"
            "    assert util.STOP_REQUESTED.is_set()\n"
            "    util.on_sigint(signal.SIGINT, None)\n"
            "    print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and "still running" not in proc.stdout
    assert "stopping after the current batch" in proc.stderr and "stopped; finished work is kept" in proc.stderr


def test_a_task_name_that_now_names_another_kernel_is_tuned_again(tmp_path):
    """After the model's passes change (a max-pool computed packed), a task keeps its name but
    is another kernel: a resumed run tunes it rather than count the old kernel's trials."""
    work = tmp_path / "work"
    mod = zoo.load("zoo:tiny_cnn").mod
    tune(mod, work, trials_per_task=2, only=["fused_matmul"])
    assert count_trials(work)["fused_matmul_add4"]["done"] == 2
    log = work / "trials.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for r in rows:  # as if those trials had tuned another kernel of that name
        if "workload" in r:
            r["workload"] = "0" * 16
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tune(mod, work, trials_per_task=2, only=["fused_matmul"])
    assert count_trials(work)["fused_matmul_add4"]["done"] == 4  # the old 2, then 2 of its own


def test_store_skips_bad_lines_and_other_targets(donor_dir, tmp_path, caplog):
    bad = tmp_path / "foreign"
    bad.mkdir()
    (bad / "database_workload.json").write_text(
        (donor_dir / "database_workload.json").read_text() + "not json\n")
    lines = (donor_dir / "database_tuning_record.json").read_text().splitlines()
    foreign = json.loads(lines[0])
    foreign[1][2] = {"kind": "llvm", "mcpu": "cortex-a72", "mtriple": "aarch64-linux-gnu"}
    (bad / "database_tuning_record.json").write_text(
        "\n".join(lines + ["{broken", json.dumps(foreign)]) + "\n")
    with caplog.at_level("WARNING", logger="ttrank"):
        ws, rep = donors.index_work_dir(bad, target=make_target())
    assert rep.skipped["malformed line"] == 1
    assert rep.skipped["other target"] == 1
    assert rep.skipped["bad workload"] == 1
    assert ws and rep.kept >= 3
    # the damage is a warning; another target's records, in any shared log, are not
    assert "1 malformed line" in caplog.text and "other target" not in caplog.text


def test_two_donor_sets_of_one_network_keep_their_records_apart(donor_dir, tmp_path):
    """A second set of the same network (tuned natively, or in another layout) tunes some of the
    same workloads: its records get ids of their own, and leaving the network out drops both."""
    other = donors.donor_set_dir(tmp_path, donor_dir.name, "nchw", 2, "somecpu")
    shutil.copytree(donor_dir, other)
    store = donors.DonorStore.load([donor_dir, other], use_cache=False)
    assert store.networks == [donor_dir.name]
    ids = [r.id for r in store.records()]
    assert len(ids) == len(set(ids)) and any(i.startswith(other.name + "/") for i in ids)
    assert not store.without({donor_dir.name}).workloads


def test_donors_add_and_list(donor_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TTRANK_CACHE", str(tmp_path / "cache"))
    # a data home that ships no donors: the listing is the user's own
    (tmp_path / "home" / "datasets" / "donors").mkdir(parents=True)
    monkeypatch.setenv("TTRANK_HOME", str(tmp_path / "home"))
    assert main(["donors", "add", str(donor_dir), "--name", "mine"]) == 0
    assert (tmp_path / "cache" / "donors" / "mine" / "database_tuning_record.json.gz").exists()
    capsys.readouterr()
    assert main(["donors", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    mine = next(r for r in rows if r["network"] == "mine")
    assert mine["kernels"] == 3 and mine["records"] >= 3
    # a shipped set's name is refused (the two would share record ids): one line, nothing written
    shutil.copytree(donor_dir, tmp_path / "home" / "datasets" / "donors" / "shipped_one")
    assert main(["donors", "add", str(donor_dir), "--name", "shipped_one"]) != 0
    assert "shipped donor set has that name" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "donors" / "shipped_one").exists()


def test_tile_adaptation_keeps_inner_tiles():
    assert transfer.adapt_tiles([1, 4, 2, 8], 64) == [1, 4, 2, 8]
    assert transfer.adapt_tiles([7, 1, 1, 2], 7) == [7, 1, 1, 1]
    assert transfer.adapt_tiles([1, 3, 12, 16], 512) == [1, 2, 16, 16]
    for extent in (7, 49, 56, 96, 112, 1000):
        new = transfer.adapt_tiles([2, 4, 8, 16], extent)
        prod = 1
        for f in new:
            prod *= f
        assert prod == extent


def test_transfer_and_measure_onto_other_shapes_and_epilogues(donor_dir, tiny_cnn, target):
    store = donors.DonorStore.load([donor_dir], use_cache=False)
    model = frontend.load(tiny_cnn)
    ks = [k for k in kernels.extract(model.mod, target) if k.tunable]
    m = measure.Measurer(target)
    try:
        counts = {"valid": 0, "rejected": 0}
        for k in ks:
            pairs = store.compatible(k)
            cands = [transfer.transfer(r, k, w, target) for w, r in pairs]
            for c in cands:
                counts["valid" if c.ok else "rejected"] += 1
            valid = [c for c in cands if c.ok][::3]  # a third of them, each donor kernel's among them
            if not valid:
                continue
            base = m.measure([k.mod])[0]
            res = m.measure([c.mod for c in valid], reference=k.mod, reference_key=k.workload_hash)
            assert base.ok
            # every transferred kernel computes what the untuned one computes
            assert all(r.status == "ok" for r in res), [r.error for r in res]
            # each latency is the minimum over the repeats of every interleaved pass
            assert all(len(r.all_secs) == m.spec.rounds * m.spec.repeat for r in res)
            assert all(r.latency_s == min(r.all_secs) for r in res)
        assert counts["valid"] > 0
        # a 3x3 conv with a residual epilogue receives schedules tuned on a plain conv+add+relu
        resid = next(k for k in ks if k.workload_class == "conv2d_nchw+add+add+relu")
        cands = [transfer.transfer(r, resid, w, target) for w, r in store.compatible(resid)]
        assert any(c.ok and c.method == "anchor" for c in cands)
        assert any(c.tile_changes for c in cands)
    finally:
        m.close()


def _tiling_order(trace) -> list[str]:
    """The loops of a trace's tiling reorder, each named by the SamplePerfectTile its split used."""
    insts = list(trace.insts)
    split_of = {o: i for i, inst in enumerate(insts) if inst.kind.name == "Split" for o in inst.outputs}
    made = {o: (i, j) for i, inst in enumerate(insts) for j, o in enumerate(inst.outputs)}
    reorder = next(inst for inst in insts if inst.kind.name == "Reorder")
    out = []
    for loop in reorder.inputs:
        src = insts[split_of[loop]].inputs[0]
        out.append(f"axis{made[src][1]}")
    return out


def test_a_conv_whose_activations_outweigh_its_weights_splits_its_rows_between_threads(donor_dir, tiny_cnn,
                                                                                       target):
    """Its outer row tiles come first, so that its threads split the output rows and each reads
    the rows it wrote in the layer before; the kernel still computes what it computed."""
    store = donors.DonorStore.load([donor_dir], use_cache=False)
    ks = [k for k in kernels.extract(frontend.load(tiny_cnn).mod, target) if k.tunable]
    conv = next(k for k in ks if transfer.splits_rows(k))
    cands = [c for c in (transfer.transfer(r, conv, w, target) for w, r in store.compatible(conv)) if c.ok]
    rows = [c for c in cands if c.thread_split == "rows"]
    assert rows and all(c.summary()["thread_split"] == "rows" for c in rows)
    for c in rows:
        order = _tiling_order(c.trace)
        spatial = order[:next(i for i, a in enumerate(order) if a in ("axis4", "axis5", "axis6"))]
        # batch and rows of both outer levels first, then channels and columns as the donor had them
        assert spatial[:4] == ["axis0", "axis2", "axis0", "axis2"] and spatial[4:] == ["axis1", "axis3"] * 2
    m = measure.Measurer(target)
    try:
        res = m.measure([c.mod for c in rows], reference=conv.mod, reference_key=conv.workload_hash)
        assert all(r.status == "ok" for r in res), [r.error for r in res]
    finally:
        m.close()
    # a matmul has no rows; a conv whose weights outweigh its activations keeps its channel split
    assert not any(transfer.splits_rows(k) for k in ks if "matmul" in k.anchor_op)
    heavy = kernels.Kernel(name="c", workload_class="", anchor_op="conv2d_NCHWc", iter_kinds="SSSSSRRRR",
                           extents=[], epilogue=[], attrs={}, input_shapes=[[1, 64, 14, 14, 8], [64, 64, 3, 3, 8, 8]],
                           output_shape=[1, 64, 7, 7, 8], dtype="float32", flops=0.0)
    assert not transfer.splits_rows(heavy)
    assert transfer.splits_rows(kernels.Kernel(**{**heavy.__dict__, "input_shapes": [[1, 8, 56, 56, 8],
                                                                                    [8, 8, 1, 1, 8, 8]],
                                                  "output_shape": [1, 8, 56, 56, 8]}))


def test_wrong_result_is_rejected(tiny_cnn, target):
    """A schedule of another kernel (different weights shape) must never pass as this one."""
    model = frontend.load(tiny_cnn)
    ks = {k.name: k for k in kernels.extract(model.mod, target)}
    k = ks["fused_conv2d1_add_relu"]
    other = ks["fused_conv2d1_add_add1_relu"]  # same conv, one more input added
    m = measure.Measurer(target)
    try:
        res = m.measure([other.mod], reference=k.mod, reference_key="ref-" + k.workload_hash)
        assert res[0].status == "wrong_result" and "max abs error" in res[0].error
    finally:
        m.close()


def test_each_kernels_reference_outputs_are_computed_once_and_shared(tiny_cnn, target):
    """Every candidate of a kernel is checked against the untuned kernel's outputs, which the
    build workers compute once per kernel and keep (its outputs only, not its weights)."""

    model = frontend.load(tiny_cnn)
    ks = {k.name: k for k in kernels.extract(model.mod, target)}
    k = ks["fused_conv2d1_add_relu"]
    m = measure.Measurer(target)
    try:
        res = m.measure([k.mod, k.mod, k.mod], reference=k.mod, reference_key=k.workload_hash)
        assert [r.status for r in res] == ["ok"] * 3
        saved = [f for f in os.listdir(os.path.join(m.builder.artifact_dir, "references"))
                 if f.endswith(".npz")]
        assert saved == [f"{k.workload_hash}.npz"]
        with np.load(os.path.join(m.builder.artifact_dir, "references", saved[0])) as z:
            n = int(z["n"])
            assert n == len(k.input_shapes) + 1 and set(z.files) == {"n", "s", f"a{n - 1}"}
    finally:
        m.close()


def test_measuring_the_untuned_kernel_leaves_the_reference_its_candidates_are_checked_against(
        tiny_cnn, target):
    """recommend measures every untuned kernel first; that same build's outputs become the
    kernel's reference, so no candidate's check compiles and runs the untuned kernel again.
    A measurer warmed before use (its workers start while the caller ranks) measures alike."""
    model = frontend.load(tiny_cnn)
    ks = {k.name: k for k in kernels.extract(model.mod, target)}
    k, other = ks["fused_conv2d1_add_relu"], ks["fused_conv2d1_add_add1_relu"]
    m = measure.Measurer(target)
    m.warm()
    try:
        [untuned] = m.baseline().measure([k.mod], as_references=[k.workload_hash])
        assert untuned.ok and len(untuned.all_secs) == 1
        refs = os.path.join(m.builder.artifact_dir, "references")
        assert os.listdir(refs) and f"{k.workload_hash}.npz" in os.listdir(refs)
        # the kernel itself agrees with its reference; another kernel's program does not
        same, wrong = m.measure([k.mod, other.mod], references=[(k.mod, k.workload_hash)] * 2)
        assert same.ok and wrong.status == "wrong_result"
    finally:
        m.close()


def test_a_slow_untuned_kernel_keeps_its_reference_runs_time(tiny_cnn, target, monkeypatch):
    """An untuned kernel whose reference run took SELF_TIMED_S or more is not run again by the
    runner (a warm-up and a timed call): that run's seconds are its latency."""
    model = frontend.load(tiny_cnn)
    k = next(k for k in kernels.extract(model.mod, target) if k.name == "fused_conv2d1_add_relu")
    monkeypatch.setattr(measure, "SELF_TIMED_S", 0.0)  # every untuned kernel counts as slow
    m = measure.Measurer(target)
    try:
        [untuned] = m.baseline().measure([k.mod], as_references=[k.workload_hash])
        with np.load(os.path.join(m.builder.artifact_dir, "references", f"{k.workload_hash}.npz")) as z:
            assert untuned.ok and untuned.all_secs == [float(z["s"])] and untuned.latency_s > 0
    finally:
        m.close()


def test_a_candidate_far_slower_than_its_kernels_best_gets_one_pass(tiny_cnn, target):
    """After a batch's first pass, a candidate over SETTLE_FACTOR x the best already measured
    for its kernel is not run again; the others get every pass."""
    model = frontend.load(tiny_cnn)
    k = next(k for k in kernels.extract(model.mod, target) if k.name == "fused_conv2d1_add_relu")
    m = measure.Measurer(target)
    try:
        batch = ([k.mod, k.mod], None, lambda: [1e-9, None])  # a best nothing can come near
        [res] = list(m.measure_stream([batch]))
        assert res[0].ok and len(res[0].all_secs) == m.spec.repeat
        assert res[1].ok and len(res[1].all_secs) == m.spec.repeat * m.spec.rounds
    finally:
        m.close()


def test_a_candidate_whose_output_check_was_far_too_slow_is_not_run(tiny_cnn, target, monkeypatch):
    """The output check calls each candidate once in its build worker: over PRESETTLE_FACTOR x its
    kernel's best known (and SELF_TIMED_S or more), that call is its latency and it is not run."""
    monkeypatch.setattr(measure, "SELF_TIMED_S", 0.0)  # every check's call counts as slow
    model = frontend.load(tiny_cnn)
    k = next(k for k in kernels.extract(model.mod, target) if k.name == "fused_conv2d1_add_relu")
    m = measure.Measurer(target)
    try:
        batch = ([k.mod, k.mod], [(k.mod, k.workload_hash)] * 2, lambda: [1e-9, None])
        [res] = list(m.measure_stream([batch]))
        assert res[0].ok and len(res[0].all_secs) == 1 and res[0].latency_s > 1e-9
        assert res[1].ok and len(res[1].all_secs) == m.spec.repeat * m.spec.rounds
    finally:
        m.close()


def test_the_batch_first_pass_settles_candidates_of_the_same_kernel(tiny_cnn, target, monkeypatch):
    """After the first pass, a candidate is compared with the best of its own kernel's
    candidates in the batch as well: with a factor under 1, each of two equal ones is settled."""
    monkeypatch.setattr(measure, "SETTLE_FACTOR", 0.5)
    model = frontend.load(tiny_cnn)
    k = next(k for k in kernels.extract(model.mod, target) if k.name == "fused_conv2d1_add_relu")
    m = measure.Measurer(target)
    try:
        batch = ([k.mod, k.mod], [(k.mod, k.workload_hash)] * 2, lambda: [None, None])
        [res] = list(m.measure_stream([batch]))
        assert all(r.ok and len(r.all_secs) == m.spec.repeat for r in res)
    finally:
        m.close()


def test_hanging_build_times_out_without_stopping_the_batch(tiny_cnn, target):
    import tvm

    model = frontend.load(tiny_cnn)
    k = next(k for k in kernels.extract(model.mod, target) if k.name == "fused_matmul_add4")
    gv = [g for g in k.mod.functions][0]
    hang = tvm.IRModule({gv: k.mod[gv].with_attr(measure.HANG_ATTR, 120)})
    m = measure.Measurer(target, build_timeout_sec=8)
    try:
        t0 = time.time()
        res = m.measure([k.mod, hang, k.mod])
        assert [r.status for r in res] == ["ok", "timeout", "ok"]
        assert time.time() - t0 < 100
    finally:
        m.close()


def test_a_kernel_measured_here_is_linked_by_ld_and_runs_its_libm_calls(target, tmp_path, monkeypatch):
    """Candidates loaded on this host are linked with ld itself (a tenth of the compiler
    driver's time); their libm calls (exp) resolve from the process that loads them."""
    import tvm
    from tvm import te
    from tvm.support import cc

    a = te.placeholder((256,), name="A")
    b = te.compute((256,), lambda i: te.exp(a[i]) * 2.0, name="B")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    monkeypatch.setattr(cc, "create_shared", lambda *a, **k: pytest.fail("the compiler driver linked it"))
    path = measure._build_export(mod, target, str(tmp_path), here=True)
    x = np.linspace(-2, 2, 256, dtype="float32")
    out = tvm.runtime.tensor(np.zeros(256, dtype="float32"))
    tvm.runtime.load_module(path)["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), 2 * np.exp(x), rtol=1e-5)


def test_reduction_blocks_named_after_other_variables_are_matched():
    assert transfer.block_renames(["lv375_red", "T_divide"], ["lv85_red", "T_divide"]) == \
        {"lv375_red": "lv85_red"}
    assert transfer.block_renames(["lv8_sum", "lv8_mean", "T_layer_norm"],
                                  ["lv3_sum", "lv3_mean", "T_layer_norm"]) == \
        {"lv8_sum": "lv3_sum", "lv8_mean": "lv3_mean"}
    assert transfer.block_renames(["pad_temp", "conv2d_nchw"], ["pad_temp", "conv2d_nchw"]) == {}


def test_a_lookup_kernel_is_timed_not_crashed_by_random_indices(target, lookup_kernel):
    """An embedding lookup (take) gets its integer index tensor zero-filled by the runner:
    MetaSchedule's random fill put the indices outside the table and the kernel crashed."""
    m = measure.Measurer(target)
    try:
        [got] = m.measure([lookup_kernel])
    finally:
        m.close()
    assert got.ok and got.latency_s > 0, got.error


def test_a_tuned_model_compiles_in_parallel_parts_to_the_same_outputs(donor_dir, target, tmp_path, caplog,
                                                                    monkeypatch):
    """The build pool compiles the kernels in parts (object files linked at export); the model
    computes what the one-process compile does, and a failed part falls back to that compile."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from ttrank import runtime

    monkeypatch.setattr(runtime, "host_cores", lambda: 2)  # as on any machine of 2 or more cores
    model = zoo.load("zoo:tiny_resnet")
    db = ms.database.JSONDatabase(work_dir=str(donor_dir))
    # the parts are compiled from the same pipeline as MetaSchedule's compile_relax: the donor
    # kernels get their tuned schedules
    with target, db, tvm.transform.PassContext(opt_level=3):
        lowered = runtime._database_pipeline(target)(model.mod)
    assert sum(bool(f.attrs and f.attrs.get("tirx.is_scheduled")) for f in lowered.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc)) == len(DONOR_KERNELS)
    whole = runtime.CompiledModel.load(
        runtime.export(runtime.compile_model(model, target, db), tmp_path / "whole.so"), model)
    builder = measure.WarmPoolBuilder(max_workers=2)
    calls = []

    def compile_objects(mods, tgt):
        calls.append(len(mods))
        return builder.compile_objects(mods, tgt)

    try:
        parts = runtime.CompiledModel.load(
            runtime.export(runtime.compile_model(model, target, db, compile_objects), tmp_path / "parts.so"),
            model)
    finally:
        builder.close()
    assert calls and calls[0] >= 2  # compiled in several parts
    assert runtime.check_against_onnxruntime(parts, model).ok
    feed = model.random_inputs()
    for a, b in zip(whole.run(feed), parts.run(feed)):
        assert abs(a - b).max() <= 1e-5

    def broken(mods, tgt):
        raise RuntimeError("build timeout: killed after 60 s")

    with caplog.at_level("WARNING", logger="ttrank"):
        ex = runtime.compile_model(model, target, db, broken)
    assert "compiling them in one process" in caplog.text
    assert runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(ex, model), model).ok


def test_compile_with_a_database_writes_only_the_checked_library(donor_dir, tmp_path, capsys):
    """`ttrank compile --database` compiles the kernels in parallel and checks the exported
    library itself; the folder then holds that library and nothing else."""
    out = tmp_path / "tiny_resnet.so"
    assert main(["compile", "zoo:tiny_resnet", "--database", str(donor_dir), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "check vs onnxruntime" in printed and "OK" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_resnet.so"]


def test_compile_with_a_database_loads_the_model_as_its_kernels_were_tuned(donor_dir, tmp_path, capsys):
    # recommend packs a CNN's convs (--layout auto) and records it beside its database: loaded
    # in another layout, no conv's workload would match and every conv would compile untuned
    db = tmp_path / "db"
    shutil.copytree(donor_dir, db)
    assert loaded_as(db) == {"layout": "nchw"}  # a tune run's manifest says it too
    write_loaded_as(db, "nchwc", True)
    assert main(["compile", "zoo:tiny_resnet", "--database", str(db), "-o", str(tmp_path / "r.so")]) == 0
    assert "layout: nchwc (the database's kernels were tuned in it)" in capsys.readouterr().out
    # a layout given on the command line wins
    assert main(["compile", "zoo:tiny_resnet", "--database", str(db), "--layout", "nchw",
                 "-o", str(tmp_path / "r.so")]) == 0
    assert "layout:" not in capsys.readouterr().out


def test_two_tuning_runs_of_a_network_merge_into_one_donor_set(donor_dir, tmp_path):
    """An adaptation published into a shipped set that an earlier one began: one database whose
    records each keep their own workload, and a repeated merge adds nothing."""
    wl = (donor_dir / WORKLOAD_FILE).read_text().splitlines()
    recs = (donor_dir / RECORD_FILE).read_text().splitlines()
    # two runs: the first tuned the records of workload 0, the second the rest, with the
    # workloads in another order (its own numbering)
    first, second = tmp_path / "first", tmp_path / "second"
    for d in (first, second):
        d.mkdir()
        (d / TRIALS_FILE).write_text("")
    (first / WORKLOAD_FILE).write_text(wl[0] + "\n")
    (first / RECORD_FILE).write_text("\n".join(r for r in recs if json.loads(r)[0] == 0) + "\n")
    order = list(reversed(range(len(wl))))
    (second / WORKLOAD_FILE).write_text("\n".join(wl[i] for i in order) + "\n")
    (second / RECORD_FILE).write_text("".join(
        json.dumps([order.index(json.loads(r)[0]), json.loads(r)[1]]) + "\n"
        for r in recs if json.loads(r)[0] != 0))

    merged = tmp_path / "merged"
    merge_work_dir(first, merged)
    added = merge_work_dir(second, merged)
    assert added["workloads"] == len(wl) - 1 and added["records"] == len(recs) - sum(
        json.loads(r)[0] == 0 for r in recs)
    manifest = (merged / "tune_manifest.json").read_text()
    assert merge_work_dir(second, merged) == {"workloads": 0, "records": 0, "trials": 0}
    assert (merged / "tune_manifest.json").read_text() == manifest  # its search time not counted twice

    def by_workload(work_dir) -> dict:
        out: dict = {}
        for r in open_database(work_dir).get_all_tuning_records():
            out.setdefault(tvm_ffi.structural_hash(r.workload.mod), []).append(sorted(map(float, r.run_secs)))
        return {k: sorted(v) for k, v in out.items()}

    assert by_workload(merged) == by_workload(donor_dir)


def test_an_adaptations_native_tuning_is_published_as_a_donor_set_of_its_cpu(donor_dir, tmp_path):
    cache, shipped = tmp_path / "cache" / "donors", tmp_path / "datasets" / "donors"
    native = cache / "native-zenx-tiny_resnet@nchwc"
    shutil.copytree(donor_dir, native)
    man = json.loads((native / "tune_manifest.json").read_text())
    man["provenance"] = {**man.get("provenance", {}), "mcpu": "zenx", "threads": 2}
    (native / "tune_manifest.json").write_text(json.dumps(man))
    shutil.copytree(donor_dir, cache / "tiny_cnn")  # the user's own donors stay theirs

    [(src, dest, added)] = donors.publish_native(cache, shipped)
    assert dest == shipped / "tiny_resnet@nchwc-t2-zenx" and added["records"] > 0
    assert donors.network_of(dest) == "tiny_resnet"
    assert donors.publish_native(cache, shipped, mcpu="other") == []
    assert donors.publish_native(cache, shipped)[0][2] == {"workloads": 0, "records": 0, "trials": 0}
    listing = json.loads(donors.write_store_manifest(shipped).read_text())["networks"]
    assert listing["tiny_resnet@nchwc-t2-zenx"]["mcpu"] == "zenx"


def test_the_models_compile_links_the_kernels_built_for_measuring(target, tmp_path, monkeypatch):
    """Kernels measured as they are (here: untuned, as every recommend measures them first) are
    linked into the model from their measuring builds, renamed, not compiled again; the model
    still computes what onnxruntime does."""
    from tvm.s_tir import meta_schedule as ms

    from ttrank import runtime

    monkeypatch.setattr(runtime, "host_cores", lambda: 2)
    model = zoo.load("zoo:tiny_cnn")
    ks = kernels.extract(model.mod, target)
    builder = measure.WarmPoolBuilder(max_workers=2, artifact_dir=str(tmp_path / "builds"))
    linked = {}

    def kept(funcs, tgt):
        linked.update(builder.kept_objects(funcs, tgt))
        return linked

    try:
        built = builder.build_references([k.mod for k in ks], target, [k.workload_hash for k in ks])
        assert all(status == "ok" for status, _ in built)
        ex = runtime.compile_model(model, target, ms.database.MemoryDatabase(), builder.compile_objects, kept)
        compiled = runtime.CompiledModel.load(runtime.export(ex, tmp_path / "model.so"), model)
    finally:
        builder.close()
    assert len(linked) >= len({k.workload_hash for k in ks}) - 1  # the model's kernels, as measured
    assert runtime.check_against_onnxruntime(compiled, model).ok


def test_a_search_starts_from_the_transferred_schedules_it_is_seeded_with(donor_dir, tiny_cnn, target,
                                                                          tmp_path, caplog):
    from ttrank.tune import SEEDED_MEASURED_RATIO, Seed

    store = donors.DonorStore.load([donor_dir], use_cache=False)
    model = frontend.load(tiny_cnn)
    # tiny_cnn's 3x3 conv, which tiny_resnet's convs of its class cover by replaying their traces
    k = next(k for k in kernels.extract(model.mod, target) if k.workload_class == "conv2d_nchw+add+relu")
    cands = [c for c in (transfer.transfer(r, k, w, target) for w, r in store.compatible(k)) if c.seedable][:2]
    m = measure.Measurer(target)
    try:
        lats = [r.latency_s for r in m.measure([c.mod for c in cands])]
    finally:
        m.close()
    assert cands and all(lats)
    seeds = {k.workload_hash: [Seed(k.workload_hash, c.trace, lat) for c, lat in zip(cands, lats)]}
    work = tmp_path / "seeded"
    tune(model.mod, work, trials_per_task=4, only=[k.name], target=target, seeds=seeds, trials_per_iter=4)
    log = "".join(p.read_text() for p in (work / "logs").glob("*.log"))
    # MetaSchedule replayed the two traces, repeated, into most of its first population (64)...
    assert re.search(r"Picked top (\d+) candidate", log).group(1) == str(int(64 * SEEDED_MEASURED_RATIO))
    assert "trace replay failures" not in log and "seeds stopped" not in caplog.text
    # ...and its database holds what its own search measured, nothing else
    assert count_trials(work)[k.name]["done"] == 4
    assert len((work / RECORD_FILE).read_text().splitlines()) == 4


def test_a_measurement_beside_other_work_says_how_much_it_took(tiny_cnn, target):
    """A measurement taken while another process spins on a core records that core as taken
    (rows keep it, and such rows are neither reused nor learned from: measurements.disturbed)."""
    k = max((k for k in kernels.extract(frontend.load(tiny_cnn).mod, target) if k.tunable), key=lambda k: k.flops)
    m = measure.Measurer(target, measure.RunnerSpec(rounds=3, min_repeat_ms=100))
    # another program's process, not ours: started by a shell that exits at once
    spinner = int(subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                                 capture_output=True, text=True, check=True).stdout)
    try:
        busy = m.measure([k.mod])[0]
    finally:
        os.kill(spinner, signal.SIGKILL)
        m.close()
    assert busy.ok and busy.foreign is not None
    assert busy.foreign.cores >= 0.5  # the spinner's core, whatever else this machine runs
    assert m.busiest() == busy.foreign
    row = measurements.row("tiny_cnn", k, busy.status, busy.latency_s, busy.error, {}, foreign=busy.foreign_json)
    assert measurements.disturbed(row, cores=0.5)
    assert not measurements.disturbed({**row, "foreign_load": {"others": 0.1, "steal": 0.0}}, cores=0.5)



def test_a_matmuls_weight_is_packed_once_when_the_model_compiles(donor_dir, target, tmp_path):
    """A matmul's constant weight is marked layout-free (convs' are not, and no kernel is
    renamed), so its schedules read it packed in their own order; the compile folds the packing
    into the constant, and the library takes the model's inputs as they are."""
    import tvm

    from ttrank import runtime

    model = zoo.load("zoo:tiny_resnet")
    ks = {k.name: k for k in kernels.extract(model.mod, target)}
    attrs = {n: k.mod["main"].attrs or {} for n, k in ks.items()}
    assert {n for n, a in attrs.items() if kernels.LAYOUT_FREE in a} == {"fused_matmul_add8"}
    assert list(attrs["fused_matmul_add8"][kernels.LAYOUT_FREE]) == [1]  # the weight, not the data or bias
    # the donor run tuned the marked kernel: its schedule packs the weight
    db = open_database(donor_dir)
    assert runtime.has_prepacked_workloads(db)
    rec = db.get_top_k(db.commit_workload(ks["fused_matmul_add8"].mod), 1)[0]
    assert "transform_layout" in str(rec.trace)
    with target, db, tvm.transform.PassContext(opt_level=3):
        lowered = runtime._database_pipeline(target)(model.mod)
    names = {gv.name_hint for gv in lowered.functions}
    assert "fused_matmul_add8_prepacked" in names and not any(n.endswith("_weight_prepack") for n in names)
    lib = runtime.export(runtime.compile_model(model, target, db), tmp_path / "packed.so")
    compiled = runtime.CompiledModel.load(lib, model)
    assert runtime.check_against_onnxruntime(compiled, model).ok

    # a database of unmarked matmuls (a MetaSchedule run's own, or one written before the
    # marking) compiles them tuned too: its workloads say how the model must be prepared
    old = tune(model.mod, tmp_path / "old", trials_per_task=2, target=target, only=["fused_matmul_add8"],
               prepare=kernels.unmark_prepacked_weights)
    assert old is not None
    old_db = open_database(tmp_path / "old")
    assert not runtime.has_prepacked_workloads(old_db)
    for prepack, scheduled in ((False, True), (True, False)):
        with target, old_db, tvm.transform.PassContext(opt_level=3):
            low = runtime._database_pipeline(target, prepack)(model.mod)
        f = next(f for gv, f in low.functions.items() if gv.name_hint.startswith("fused_matmul_add8"))
        assert bool(f.attrs.get("tirx.is_scheduled")) is scheduled
    assert runtime.check_against_onnxruntime(runtime.CompiledModel.from_executable(
        runtime.compile_model(model, target, old_db), model), model).ok
