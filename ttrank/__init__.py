"""ttrank: compile a new network fast by ranking and reusing schedules tuned for other networks."""

__version__ = "0.1.0"

from .target import use_host_threads  # noqa: E402

use_host_threads()  # before any TVM runtime thread pool starts

from .engine import KernelReport, Result  # noqa: E402
from .errors import TTRankError  # noqa: E402
from .transfer import Candidate  # noqa: E402

__all__ = ["Candidate", "KernelReport", "Result", "TTRankError", "load", "rank", "recommend"]


def load(path, input_shapes=None, fast_math: bool = False):
    """Load an ONNX model, or ``"zoo:NAME"`` for a zoo network (``input_shapes``:
    {name: [dims]} for dynamic inputs; ``fast_math``: :func:`ttrank.frontend.with_fast_math`)."""
    from .frontend import load as _load

    if isinstance(path, str) and path.startswith("zoo:"):
        from .zoo import cached

        path = cached(path[4:])
    return _load(path, input_shapes, fast_math=fast_math)


def _as_model(model, input_shapes=None):
    from .frontend import LoadedModel

    return model if isinstance(model, LoadedModel) else load(model, input_shapes)


def rank(model_or_kernel, k: int | None = None, *, store=None, ranker=None, target=None,
         exclude_networks=(), input_shapes=None, programs: bool = True):
    """Rank donor schedules without measuring.

    For a :class:`~ttrank.kernels.Kernel`, the list of its best ``k`` Candidates (all if None);
    for a model (path or LoadedModel), a dict kernel name -> that list. Each Candidate carries
    the donor record (id, network, kernel, trace), the predicted score and the features.
    ``programs``: apply the ranker's second stage, if its evaluation kept one, as ``recommend``
    does (the shortlist is transferred and reordered by the program cost model, at 0.1-0.3 s
    per shortlisted candidate; those Candidates carry ``cost_score``).
    """
    from .donors import DonorStore
    from .engine import rank_kernel, rerank_kernel, second_stage
    from .kernels import Kernel, extract
    from .ranker import Ranker
    from .target import make_target

    target = target if target is not None else make_target()
    store = store if store is not None else DonorStore.load()
    ranker = ranker if ranker is not None else Ranker.load()
    exclude = set(exclude_networks)
    stage = second_stage(ranker, store, target, exclude) if programs else None

    def one(kern):
        cands = rank_kernel(kern, store, ranker, exclude)
        if stage is not None:
            cands, _ = rerank_kernel(kern, cands, stage, target)
        return cands[:k]

    if isinstance(model_or_kernel, Kernel):
        return one(model_or_kernel)
    model = _as_model(model_or_kernel, input_shapes)
    return {kern.name: one(kern) for kern in extract(model.mod, target)}


def recommend(model, *, input_shapes=None, **kwargs) -> Result:
    """Transfer-tune a model end to end; see :func:`ttrank.engine.recommend` for the options.

    Returns a :class:`Result`: chosen schedules per kernel, the database path, the compiled
    module (``result.compiled``), latencies and the per-kernel report.
    """
    from .engine import recommend as _recommend

    return _recommend(_as_model(model, input_shapes), **kwargs)
