"""ttrank: compile a new network fast by ranking and reusing schedules tuned for other networks."""

__version__ = "0.1.0"

from .target import use_host_threads  # noqa: E402

use_host_threads()  # before any TVM runtime thread pool starts

from .coverage import choose_layout  # noqa: E402
from .donors import DonorStore  # noqa: E402
from .errors import TTRankError  # noqa: E402
from .frontend import LoadedModel  # noqa: E402
from .kernels import Kernel, extract  # noqa: E402
from .pipeline import KernelReport, Result  # noqa: E402
from .pipeline import recommend as _recommend  # noqa: E402
from .ranker import Ranker  # noqa: E402
from .ranking import Candidate, SecondStage, rank_kernel, rerank  # noqa: E402
from .target import make_target, target_cpu  # noqa: E402
from .zoo import load  # noqa: E402

__all__ = ["Candidate", "KernelReport", "Result", "TTRankError", "load", "rank", "recommend"]


def _as_model(model, input_shapes=None, fast_math: bool = True, layout: str = "nchw",
              target=None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    return load(model, input_shapes, fast_math, layout=layout, target=target)


def rank(model_or_kernel, k: int | None = None, *, store=None, ranker=None, target=None,
         exclude_networks=(), input_shapes=None, programs: bool = True, fast_math: bool = True,
         layout: str = "nchw"):
    """Rank donor schedules without measuring.

    For a :class:`~ttrank.kernels.Kernel`, the list of its best ``k`` Candidates (all if None);
    for a model (path or LoadedModel), a dict kernel name -> that list. Each Candidate carries
    the donor record (id, network, kernel, trace), the predicted score and the features.
    ``programs``: apply the ranker's second stage, if its evaluation kept one, as ``recommend``
    does (the shortlist is transferred and reordered by the program cost model, at 0.1-0.3 s
    per shortlisted candidate; those Candidates carry ``cost_score``). ``fast_math``: a model
    given by path is loaded with vectorised exp/erf/tanh (False: libm's exact ones).
    ``layout``: its convs' layout ("nchw", "nchwc", "nhwc"; see :func:`ttrank.frontend.load`).
    """
    target = target if target is not None else make_target()
    store = store if store is not None else DonorStore.load()
    ranker = ranker if ranker is not None else Ranker.load()
    exclude = set(exclude_networks)
    stage = SecondStage.of(ranker, store, target, exclude) if programs else None
    cpu = target_cpu(target)  # scored for the CPU the target names

    def one(kern: Kernel) -> list[Candidate]:
        cands = rank_kernel(kern, store, ranker, exclude, cpu)
        if stage is not None:
            cands, _ = rerank(kern, cands, stage, target)
        return cands[:k]

    if isinstance(model_or_kernel, Kernel):
        return one(model_or_kernel)
    model = _as_model(model_or_kernel, input_shapes, fast_math, layout, target)
    return {kern.name: one(kern) for kern in extract(model.mod, target)}


def recommend(model, *, input_shapes=None, fast_math: bool = True, layout: str = "auto",
              **kwargs) -> Result:
    """Transfer-tune a model end to end; see :func:`ttrank.pipeline.recommend` for the options.
    ``fast_math``, ``layout``: as in :func:`rank`; ``layout="auto"`` (the default) packs the
    convs of a model as imported when the packing reaches its convs and the donor store covers
    every packed one (:func:`ttrank.coverage.choose_layout`).

    Returns a :class:`Result`: chosen schedules per kernel, the database path, the compiled
    module (``result.compiled``), latencies and the per-kernel report.
    """
    target = kwargs.get("target")
    if layout != "auto":
        return _recommend(_as_model(model, input_shapes, fast_math, layout, target), **kwargs)
    loaded = _as_model(model, input_shapes, fast_math, "nchw", target)
    if kwargs.get("store") is None:
        kwargs["store"] = DonorStore.load()
    excluded = set(kwargs.get("exclude_networks", ()))
    if kwargs.get("leave_one_out"):
        excluded.add(loaded.name)
    chosen, _ = choose_layout(loaded, kwargs["store"], target or make_target(), excluded)
    return _recommend(chosen, **kwargs)
