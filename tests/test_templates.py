"""Template schedules: a packed conv's register-tiled loop nest, as a candidate beside its donors."""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm

from ttrank import kernels, runtime, templates, zoo
from ttrank.measure import _run_host
from ttrank.target import make_target
from ttrank.transfer import transfer


def _packed_convs(tiny_cnn, target) -> list[kernels.Kernel]:
    model = zoo.load(str(tiny_cnn), layout="nchwc", target=target)
    return [k for k in kernels.model_kernels(model, target) if templates.applies(k)]


def test_a_packed_conv_gets_template_schedules_that_compute_what_it_computes(tiny_cnn, target):
    convs = _packed_convs(tiny_cnn, target)
    assert convs, "tiny_cnn in the packed layout has dense packed convs"
    for k in convs:
        cands = templates.template_candidates(k, target, n=2)
        assert cands and all(c.record.network == templates.TEMPLATE_NETWORK for c in cands)
        assert len({c.record.id for c in cands}) == len(cands)
        for c in cands:
            # replayed like any donor record, post-processed, and the same sums as the kernel
            t = transfer(c.record, k, c.donor, target)
            assert t.ok, t.reason
            _, want, _ = _run_host(k.mod)
            _, got, _ = _run_host(t.mod)
            np.testing.assert_allclose(got[-1], want[-1], rtol=1e-4, atol=1e-4)
        # the same kernel gives the same records: a rerun finds their measurements
        assert [c.record.trace_hash for c in templates.template_candidates(k, target, n=2)] == \
            [c.record.trace_hash for c in cands]


def test_other_kernels_get_no_template(tiny_cnn, target):
    model = zoo.load(str(tiny_cnn), target=target)  # as exported: NCHW convs
    assert not any(templates.template_candidates(k, target) for k in kernels.model_kernels(model, target))
    # packed, its 1x1 and depthwise convs keep their donors
    packed = kernels.model_kernels(zoo.load(str(tiny_cnn), layout="nchwc", target=target), target)
    pointwise = [k for k in packed if k.anchor_op == "conv2d_NCHWc" and k.extents[6] * k.extents[7] == 1]
    depthwise = [k for k in packed if k.anchor_op == "depthwise_conv2d_NCHWc"]
    assert pointwise and depthwise
    assert not any(templates.applies(k) for k in pointwise + depthwise)


def test_tiles_fill_the_registers_with_whole_rows_and_columns(tiny_cnn, target):
    k = _packed_convs(tiny_cnn, target)[0]
    avx512, avx2 = make_target({"kind": "llvm", "mcpu": "skylake-avx512"}), make_target({"kind": "llvm", "mcpu": "haswell"})
    assert templates.accumulators(avx512, 16) == 28
    assert templates.accumulators(avx2, 8) == 12 and templates.accumulators(avx2, 16) == 6

    def shaped(oc_chunks: int, size: int, kw: int, lanes: int = 16) -> kernels.Kernel:
        ext = list(k.extents)
        ext[1], ext[2], ext[3], ext[4], ext[7] = oc_chunks, size, size, lanes, kw
        return dataclasses.replace(k, extents=ext)

    # YOLO's 3x3 conv at 52x52, 80 channels: 13 rows of a column, then 4 x 4 pixels
    assert [(t.ocn, t.rows, t.regn, t.unroll_kw) for t in templates.tiles(shaped(5, 52, 3), avx512)] == \
        [(1, 13, 1, True), (1, 4, 4, True)]
    # 13 is prime: under AVX2's 12 accumulators, a whole column of 13 rather than one pixel
    assert (templates.tiles(shaped(16, 13, 3, lanes=8), avx2)[0].rows, templates.tiles(shaped(16, 13, 3, lanes=8), avx2)[0].regn) == (13, 1)
    for size, kw, cpu, lanes in [(13, 1, avx512, 16), (56, 3, avx512, 16), (56, 3, avx2, 8), (7, 3, avx2, 16),
                                 (13, 3, avx2, 8)]:
        tiles = templates.tiles(shaped(16, size, kw, lanes), cpu)
        assert tiles and len(set(tiles)) == len(tiles)
        for t in tiles:  # whole rows and columns, in the registers
            assert size % t.rows == 0 and size % t.regn == 0 and 16 % t.ocn == 0
            assert t.ocn * t.rows * t.regn <= templates.accumulators(cpu, lanes) + templates.OVERFLOW_REGISTERS
            assert t.unroll_kw == (kw > 1)


def test_a_kernel_the_template_cannot_schedule_keeps_its_donors(tiny_cnn, target, monkeypatch):
    k = _packed_convs(tiny_cnn, target)[0]

    def refuse(mod, tile):
        raise tvm.error.InternalError("no")

    monkeypatch.setattr(templates, "schedule", refuse)
    assert templates.template_candidates(k, target) == []


def test_a_search_that_beat_nothing_leaves_the_default_code(tiny_cnn, target, tmp_path):
    """recommend's own tuning database holds every record it tried: only the kernels whose
    search beat their default code take its best into the model's database."""
    k = _packed_convs(tiny_cnn, target)[0]
    cand = templates.template_candidates(k, target)[0]
    tried = runtime.write_database(tmp_path / "tuning", [k], {k.name: transfer(cand.record, k, cand.donor, target)},
                                   target)  # stands for the search's own database
    assert tried.has_workload(k.mod)
    lost = runtime.write_database(tmp_path / "lost", [k], {}, target, extra_db=tried)
    assert not lost.has_workload(k.mod)
    won = runtime.write_database(tmp_path / "won", [k], {}, target, extra_db=tried, extra_kernels={k.name})
    assert len(won.get_top_k(won.commit_workload(k.mod), 1)) == 1
