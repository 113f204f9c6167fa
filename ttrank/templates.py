"""Template schedules: register-tiled convolutions written the way hand-tuned CPU libraries
write them, measured beside the donors' schedules.

MetaSchedule's search reaches a dense packed conv's fast region slowly: on rocketlake, YOLO's
64x52x52 -> 80 3x3 conv ran 1.27 ms with the best transferred donor schedule, onnxruntime's
MLAS kernel 0.84 ms, and this template 0.86 ms. The template is MLAS's loop nest for NCHWc: a
tile of ``rows`` x ``regn`` output pixels times ``ocn`` channel blocks accumulates in registers
(one vector per pixel and channel block) over every input channel and kernel tap, the input
pixel broadcast and the weights loaded as vectors; (channel blocks, rows) tiles are spread over
the cores; the fused epilogue runs on each finished tile.

Its schedules enter the pipeline as records of the kernel itself (network ``template``), as
design-space draws do, so they are replayed, checked, measured and chosen like a donor's.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from .donors import DonorWorkload
from .features import divisors
from .kernels import Kernel
from .ranking import Candidate
from .layouts import simd_lanes
from .target import make_target, target_isa

TEMPLATE_NETWORK = "template"
# vector registers a tile's loads need beside its accumulators (the weights' vectors, the
# broadcast input pixel)
SPARE_REGISTERS = 4
# (most output channel blocks, most accumulators out of 28, rows or columns first on a tie):
# each rule gives a kernel one tile, measured in this order. Chosen greedily over every tile
# of up to 4 blocks x 14 rows x 28 columns, timed on 29 packed convs of YOLO, GoogLeNet and
# ResNet-50 (rocketlake): the best of the first, of two and of three ran 1.13x, 1.04x and 1.02x
# the best tile's time (geometric mean); beside each kernel's recommended schedule (ranker
# picks, leave-one-network-out), the three took the kernels to 0.935x of it.
TILE_RULES = ((1, 14, "rows"), (3, 24, "rows"), (4, 16, "columns"))
MAX_ROWS = 14
# accumulators past the registers' room a tile may take when whole rows and columns fit no
# tile near a rule's cap (:func:`tiles`)
OVERFLOW_REGISTERS = 2

log = logging.getLogger("ttrank")


class Tile(NamedTuple):
    """One template configuration: ``ocn`` channel blocks x ``rows`` x ``regn`` output pixels
    per tile, and whether the kernel-column loop is unrolled too."""

    ocn: int
    regn: int
    unroll_kw: bool
    rows: int = 1

    @property
    def key(self) -> str:
        return f"{self.ocn}x{self.rows}x{self.regn}{'u' if self.unroll_kw else ''}"


def applies(kernel: Kernel) -> bool:
    """Whether the template schedules ``kernel``: a packed (NCHWc) dense conv with its loop
    nest (batch, channel blocks, rows, columns, channel lanes; then input channel blocks,
    kernel rows, kernel columns, input lanes) and a window wider than one pixel.

    Left to their donors: 1x1 convs, whose templates won when measured alone (cold caches) and
    lost in the model (on rocketlake, ResNet-50's seven chosen had run 6-22% faster alone, and
    its 1x1 convs then took 14% longer in its profile, 21.4 against 18.8 ms; YOLO's 7%), and
    packed depthwise convs (the same loop nest without the input channels lost to the
    recommended schedule on 14 of 16 MobileNetV2 and MnasNet kernels: they are bound by
    memory, and it pads the whole input first)."""
    return (kernel.anchor_op == "conv2d_NCHWc" and kernel.iter_kinds == "SSSSSRRRR"
            and kernel.extents[6] * kernel.extents[7] > 1)


def accumulators(target, lanes: int) -> int:
    """How many ``lanes``-wide accumulators fit in ``target``'s vector registers beside
    :data:`SPARE_REGISTERS`: 32 registers with AVX-512 and on Arm, 16 with AVX2 (or a CPU this
    LLVM does not know); an accumulator wider than the registers takes several."""
    isa = target_isa(target)
    registers = 32 if isa.get("avx512") or isa.get("arm") else 16
    return max(1, (registers - SPARE_REGISTERS) // -(-lanes // simd_lanes(target)))


def tiles(kernel: Kernel, target=None) -> list[Tile]:
    """The configurations worth measuring for ``kernel`` on ``target``, the likeliest first
    (:data:`TILE_RULES`, each the largest tile of whole rows and columns under its cap)."""
    oc_chunks, height, width, lanes = kernel.extents[1:5]
    kw = kernel.extents[7]
    room = accumulators(target if target is not None else make_target(), lanes)
    out: list[Tile] = []
    for most_blocks, cap, prefer in TILE_RULES:
        cap = max(1, cap * room // 28)
        ocn = max(d for d in divisors(oc_chunks) if d <= min(most_blocks, cap))
        tile = _largest(ocn, height, width, cap, prefer, kw > 1)
        if 2 * tile.ocn * tile.rows * tile.regn < cap:
            # the sizes' divisors skip the cap (13x13 under AVX2's 6): one channel block over
            # the next whole row or column, a register or two spilled. Under AVX2 code (haswell,
            # run on rocketlake) a 16x13x13x8 3x3 conv ran 1.69x faster in 13 accumulators than
            # in one, and the best of up to 12 was the best overall on 5 of 6 YOLO convs
            tile = _largest(1, height, width, room + OVERFLOW_REGISTERS, prefer, kw > 1)
        if tile not in out:
            out.append(tile)
    return out


def _largest(ocn: int, height: int, width: int, cap: int, prefer: str, unroll_kw: bool) -> Tile:
    """The tile of ``ocn`` channel blocks over the most whole rows x columns under ``cap``
    accumulators (up to :data:`MAX_ROWS` rows), ``prefer`` ("rows" or "columns") on a tie."""
    pixels = [(r * x, x if prefer == "columns" else r, r, x) for r in divisors(height) for x in divisors(width)
              if ocn * r * x <= cap and r <= MAX_ROWS]
    _, _, rows, regn = max(pixels)
    return Tile(ocn, regn, unroll_kw, rows)


def schedule(mod, tile: Tile):
    """The template applied to a packed conv kernel's module (an ``s_tir.Schedule``): raises if
    the kernel's blocks are not a packed conv and its elementwise epilogue."""
    from tvm import s_tir  # TVM loads slowly: only when a kernel needs it

    sch = s_tir.Schedule(mod)
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    names = [sch.get(b).name_hint for b in blocks]
    anchor = next(n for n in names if n.startswith("conv2d_NCHWc"))
    conv = blocks[names.index(anchor)]
    pad = blocks[names.index("data_pad")] if "data_pad" in names else None
    out = None
    for b, name in zip(blocks, names):
        if name in (anchor, "data_pad"):
            continue
        try:
            sch.compute_inline(b)
        except Exception:  # noqa: BLE001 - the output block: computed on each finished tile
            if out is not None:
                raise ValueError("more than one epilogue block cannot be inlined") from None
            out = b
    acc = sch.cache_write(conv, 0, "local")
    b_, oc, y, x, o, ic, kh, kw, icb = sch.get_loops(conv)
    oc_o, oc_i = sch.split(oc, [None, tile.ocn])
    y_o, y_i = sch.split(y, [None, tile.rows])
    x_o, x_i = sch.split(x, [None, tile.regn])
    sch.reorder(b_, oc_o, y_o, x_o, ic, kh, kw, icb, oc_i, y_i, x_i, o)
    sch.parallel(sch.fuse(b_, oc_o, y_o))
    sch.reverse_compute_at(acc, x_o)
    if out is not None:
        sch.reverse_compute_at(out, x_o)
    for blk in (acc, out):
        if blk is not None:
            sch.vectorize(sch.get_loops(blk)[-1])
    sch.unroll(oc_i)
    sch.unroll(y_i)
    sch.unroll(x_i)
    if tile.unroll_kw:
        sch.unroll(kw)
    sch.vectorize(o)
    sch.decompose_reduction(conv, ic)
    if pad is not None:  # padded once, on every core, before the conv reads it
        loops = sch.get_loops(pad)
        sch.parallel(sch.fuse(*loops[:3]))
        sch.vectorize(loops[-1])
    return sch


def template_candidates(kernel: Kernel, target, n: int = 1) -> list[Candidate]:
    """Up to ``n`` template schedules of ``kernel`` (:func:`tiles` order), as candidates with no
    ranker score; none when the template does not apply."""
    if n < 1 or not applies(kernel):
        return []
    donor = DonorWorkload.of_kernel(TEMPLATE_NETWORK, kernel)
    for tile in tiles(kernel, target)[:n]:
        try:
            donor.add(tile.key, schedule(kernel.mod, tile), target)
        except Exception as e:  # noqa: BLE001 - a kernel the template cannot schedule keeps its donors
            log.debug("template %s does not apply to %s: %s", tile.key, kernel.name, e)
    return [Candidate(kernel, donor, r, 0.0) for r in donor.records]
