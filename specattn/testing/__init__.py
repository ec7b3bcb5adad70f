"""``specattn.testing``: the conformance kit every backend passes, ours or a user's.

>>> from specattn.testing import check_backend
>>> report = check_backend("torch_ref")           # doctest: +SKIP
>>> print(report)                                 # doctest: +SKIP

``check_backend(name_or_class, ...)`` runs the contract of a draft attention backend against
the reference (``torch_ref``): decode over all steps (``lane`` and ``path`` trees, topk 1 and
> 1, page size 1 and > 1, ragged lengths with ``L = 1``, one KV head per rank, MHA and MLA as
the class declares), extend (ragged, new tokens counted once), the pool written at exactly
``out_cache_loc``, NaN-poisoned pools, engine-style inputs (strided index tensors, q/k/v views
of a fused projection, a column slice of ``req_to_token``, K and V in one buffer), the CUDA
graph protocol (captured on CUDA, eager elsewhere), determinism, and the bad inputs every
backend must refuse with a specattn error. ``conformance_tests(...)`` gives the same cases
as pytest tests in one line; ``specattn.testing.strategies`` has Hypothesis strategies
(imported on use: it needs the ``hypothesis`` package).
"""

from .kit import NothingRunsHereWarning, check_backend, conformance_tests, run_case
from .report import CaseResult, ConformanceError, ConformanceReport
from .rounds import EngineStyle, ModelShape, RoundMaker

__all__ = ["check_backend", "conformance_tests", "run_case", "NothingRunsHereWarning",
           "CaseResult", "ConformanceError", "ConformanceReport", "EngineStyle", "ModelShape",
           "RoundMaker"]
