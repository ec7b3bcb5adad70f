"""``check_backend`` and ``conformance_tests``: the conformance kit's two entry points."""

from __future__ import annotations

import fnmatch
import logging
import time
import traceback
import warnings
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence, Union

import torch

from ..platforms import Platform
from .checks import Case, CaseFailed, CaseSkipped, Session
from .plan import LEVELS, limit_for, plan_cases
from .report import (FAILED, LIMIT, PASSED, SKIPPED, CaseResult, ConformanceError,
                     ConformanceReport)
from .target import BackendSpec, Target

__all__ = ["check_backend", "conformance_tests", "run_case", "NothingRunsHereWarning"]

log = logging.getLogger(__name__)


class NothingRunsHereWarning(UserWarning):
    """Every kit case of the backend is skipped on this machine (``conformance_tests``: as
    planned, so a plain ``pytest -q`` would print only "N skipped"; ``check_backend``: as
    run, e.g. a constructor that refuses every shape the kit tries, whose report is still
    ``ok``); the warning says why."""


def _target(backend: BackendSpec, platform, device, setup, decode_options,
            extend_options) -> Target:
    return Target.build(backend, platform=platform, device=device, setup=setup,
                        decode_options=decode_options, extend_options=extend_options)


def run_case(session: Session, case: Case, skip_reason: Optional[str] = None) -> CaseResult:
    """Run one planned case (inside the target's environment) and classify the outcome."""
    cls = session.target.class_for(case.kind, case.model)
    if skip_reason is not None:
        return CaseResult(case.id, SKIPPED, skip_reason)
    limit = limit_for(cls, case.id) if isinstance(cls, type) else None
    if limit is not None:
        return CaseResult(case.id, LIMIT, limit)
    start = time.perf_counter()
    try:
        with session.target.environment():
            detail = case.body(session, case)
        status = PASSED
    except CaseSkipped as exc:
        status, detail = SKIPPED, str(exc)
    except CaseFailed as exc:
        status, detail = FAILED, str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash is a failure with its place
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        status = FAILED
        detail = (f"raised {type(exc).__name__}: {exc} (at {frame.filename.rsplit('/', 1)[-1]}"
                  f":{frame.lineno})")
    return CaseResult(case.id, status, detail, time.perf_counter() - start)


def check_backend(backend: BackendSpec, *, device: Union[str, torch.device, None] = None,
                  platform: Optional[Platform] = None,
                  setup: Optional[Callable[[], ContextManager[Any]]] = None,
                  kinds: Sequence[str] = ("decode", "extend"),
                  models: Sequence[str] = ("mha", "mla"), level: str = "quick",
                  seed: int = 0, select: Optional[str] = None,
                  decode_options: Optional[Mapping[str, Any]] = None,
                  extend_options: Optional[Mapping[str, Any]] = None,
                  raise_on_failure: bool = True) -> ConformanceReport:
    """Run the conformance kit on a backend: return its report when every case passed (or
    was skipped, with its reason), else raise ``ConformanceError``, which holds the report
    (``raise_on_failure=False``: return the report either way).

    backend: a registered name (resolved like the factory: aliases, dispatchers, the flavour
        that runs here), a backend class, or a list of classes (a decode and an extend class).
    device: where tensors live; default the platform's device when torch has it, else CPU.
    platform: a ``specattn.platforms.Platform`` to make current (for example a GPU platform
        with the vendor library replaced by a stand-in on a CPU); default: this machine.
    setup: a zero-argument callable returning a context manager entered around every call
        (install stand-in modules, patch a library, ...).
    kinds / models: restrict to ``"decode"``/``"extend"`` and ``"mha"``/``"mla"``.
    level: ``"quick"`` (every contract point once per model and dtype) or ``"full"`` (adds
        the grid of topk x page sizes x tree modes x dtypes).
    select: only cases whose id contains this substring.
    decode_options / extend_options: extra keyword arguments for the constructors.
    raise_on_failure: raise ``ConformanceError`` (an ``AssertionError``) if a case failed
        (default); ``False``: only report.

    What runs is decided by the class's declared capabilities (``dtypes``, ``page_sizes``,
    ``max_topk``, ``tree_modes``, ``kv_cache_dtypes``, ``supports_cuda_graph``, ``models``);
    cases matching ``known_limits`` are reported as declared limits.
    """
    if level not in LEVELS:
        from ..errors import InvalidInputError

        raise InvalidInputError("level", f"one of {LEVELS}", repr(level))
    target = _target(backend, platform, device, setup, decode_options, extend_options)
    session = Session(target, seed=seed, level=level)
    report = ConformanceReport(target.label, str(target.device), str(target.platform))
    for case, reason in plan_cases(target, kinds=kinds, models=models, level=level):
        if select is not None and select not in case.id:
            continue
        result = run_case(session, case, reason)
        log.debug("%s", result.line())
        report.results.append(result)
    if report.results and report.passed == 0 and report.ok:
        reasons = "; ".join(dict.fromkeys(r.detail for r in report.results))
        warnings.warn(NothingRunsHereWarning(
            f"specattn conformance kit for {target.label}: no case ran ({reasons[:300]})"),
            stacklevel=2)
    if raise_on_failure and not report.ok:
        raise ConformanceError(report)
    return report


def conformance_tests(backend: BackendSpec, **options: Any):
    """A pytest test function with one test per kit case, for a test module to bind::

        from specattn.testing import conformance_tests
        test_my_backend = conformance_tests("mine")

    ``options`` are ``check_backend``'s (``device``, ``platform``, ``setup``, ``level``, ...),
    plus ``expected_failures``: ``{case-id pattern: why}`` marked as strict xfails (a known
    bug being fixed: the test fails once the case starts passing, so the mark gets removed).
    Skipped cases and declared limits show as pytest skips with their reasons."""
    import pytest

    expected_failures = dict(options.pop("expected_failures", {}) or {})
    kinds = options.pop("kinds", ("decode", "extend"))
    models = options.pop("models", ("mha", "mla"))
    level = options.pop("level", "quick")
    seed = options.pop("seed", 0)
    target = _target(backend, options.pop("platform", None), options.pop("device", None),
                     options.pop("setup", None), options.pop("decode_options", None),
                     options.pop("extend_options", None))
    if options:
        raise TypeError(f"conformance_tests: unexpected options {sorted(options)}")
    session = Session(target, seed=seed, level=level)
    planned = plan_cases(target, kinds=kinds, models=models, level=level)
    if planned and all(reason for _, reason in planned):
        reasons = "; ".join(dict.fromkeys(reason for _, reason in planned if reason))
        warnings.warn(NothingRunsHereWarning(
            f"specattn conformance kit for {target.label}: no case runs here ({reasons}); "
            "`pytest -rs` lists each case's reason"), stacklevel=2)

    params = []
    for case, reason in planned:
        why = next((w for p, w in expected_failures.items() if fnmatch.fnmatchcase(case.id, p)),
                   None)
        marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
        params.append(pytest.param((case, reason), id=case.id, marks=marks))

    @pytest.mark.parametrize("planned_case", params)
    def test_conformance(planned_case):
        result = run_case(session, *planned_case)
        if result.status in (SKIPPED, LIMIT):
            pytest.skip(f"{result.status}: {result.detail}")
        if result.status == FAILED:
            pytest.fail(f"{result.case}: {result.detail}", pytrace=False)

    test_conformance.__doc__ = f"specattn conformance kit for {target.label}"
    return test_conformance
