"""The benchmark loop: cases x variants, with a progress bar, into report rows."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .._console import ItemProgress
from .cases import Case
from .options import BackendOption
from .parts import measure_parts
from .harness import (Result, Variant, build_setup, discover_variants, measure_variant,
                      short_error)
from .report import FLOOR, READ_FLOOR

__all__ = ["Plan", "plan_cases", "run_cases", "run_sweep", "case_fields",
           "result_row", "floor_row", "read_floor_row", "matmul_tflops", "tflops_note"]


def case_fields(case: Case, lengths: list[int]) -> dict[str, Any]:
    """The case's columns of a row (FP8: the pools' dtype, scales and bf16 twin)."""
    return {"case": case.name, "lengths": case.lengths_label, "kind": case.kind,
            "model": case.model, "batch": case.batch, "prefix": case.prefix,
            "topk": case.topk if case.kind == "decode" else "", "steps": case.steps,
            "page_size": case.page_size, "dtype": str(case.dtype).replace("torch.", ""),
            "kv_dtype": case.kv_dtype_name, "k_scale": case.k_scale if case.fp8 else None,
            "v_scale": case.v_scale if case.fp8 and case.model == "mha" else None,
            "twin_case": case.twin, "lanes": case.lanes, "kv_bytes": case.kv_bytes(lengths)}


def floor_row(case: Case, lengths: list[int], bandwidth: float) -> dict[str, Any]:
    """The case's floor: its ``kv_bytes`` over the copy bandwidth (bytes/s)."""
    floor_us = case.kv_bytes(lengths) / bandwidth * 1e6
    return {**case_fields(case, lengths), "variant": FLOOR, "backend": "", "mode": "floor",
            "kernel_library": "", "status": "floor", "time_us": floor_us,
            "timing": "computed", "floor_us": floor_us, "copy_bw_gbs": bandwidth / 1e9}


def read_floor_row(case: Case, lengths: list[int], bandwidth: Optional[float],
                   ms: Optional[float], timing: str = "", notes: Sequence[str] = (),
                   error: str = "") -> dict[str, Any]:
    """The case's read floor (``floors.py``): ``ms`` per launch, or the ``error`` that
    stopped its measurement (then a failed row)."""
    return {**case_fields(case, lengths), "variant": READ_FLOOR, "backend": "",
            "mode": "read-floor", "kernel_library": "triton",
            "status": "failed" if ms is None else "floor", "error": error,
            "time_us": None if ms is None else ms * 1e3, "timing": timing,
            "floor_us": case.kv_bytes(lengths) / bandwidth * 1e6 if bandwidth else None,
            "copy_bw_gbs": bandwidth / 1e9 if bandwidth else None, "notes": list(notes)}


def matmul_tflops(device) -> Optional[float]:
    """TFLOP/s of an 8192^3 bf16 torch matmul on random data, measured once per process
    (CUDA only): the yardstick of ``compute_bound`` cases."""
    if device.type != "cuda":
        return None
    if not hasattr(matmul_tflops, "rate"):
        import triton

        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        matmul_tflops.rate = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    return matmul_tflops.rate


def tflops_note(case: Case, lengths: list[int], step_ms: Optional[float],
                matmul: Optional[float]) -> list[str]:
    """``["N TFLOP/s (P% of the bf16 matmul rate M TFLOP/s, same process)"]`` for a
    ``compute_bound`` case's timed row, else ``[]``."""
    if not case.compute_bound or not step_ms:
        return []
    rate = case.flops(lengths) / (step_ms * 1e-3) / 1e12
    if matmul is None:
        return [f"{rate:,.0f} TFLOP/s"]
    return [f"{rate:,.0f} TFLOP/s ({100 * rate / matmul:.0f}% of the bf16 matmul rate "
            f"{matmul:,.0f} TFLOP/s, same process)"]


def result_row(case: Case, lengths: list[int], variant: Variant, result: Result,
               bandwidth: Optional[float], matmul: Optional[float] = None) -> dict[str, Any]:
    """One variant's row (``bandwidth`` None: not measured, no floor)."""
    def us(ms):
        return None if ms is None else ms * 1e3

    return {**case_fields(case, lengths), "variant": variant.label,
            "backend": variant.backend, "mode": variant.mode,
            "kernel_library": variant.kernel_library, "status": result.status,
            "error": result.error, "max_err": result.max_err, "time_us": us(result.step_ms),
            "spread": result.step_spread, "timing": result.step_timing,
            "floor_us": case.kv_bytes(lengths) / bandwidth * 1e6 if bandwidth else None,
            "round_layers": result.round_layers if result.round_eager_ms else "",
            "round_eager_us": us(result.round_eager_ms),
            "round_graph_us": us(result.round_graph_ms),
            "round_us": us(result.engine_round_ms), "round_host_us": us(result.engine_host_ms),
            "copy_bw_gbs": bandwidth / 1e9 if bandwidth else None, "parts": result.parts,
            "notes": result.notes + tflops_note(case, lengths, result.step_ms, matmul)}


class Plan:
    """One case with the variants that will run it and those that cannot (and why)."""

    def __init__(self, case: Case, variants: list[Variant],
                 skipped: list[tuple[str, str]]) -> None:
        self.case, self.variants, self.skipped = case, variants, skipped


def plan_cases(cases: list[Case], platform, backends: Optional[list[str]],
               raw: bool, on_gpu: Optional[bool] = None,
               options: Sequence[BackendOption] = ()) -> list[Plan]:
    plans = []
    for case in cases:
        variants, skipped = discover_variants(case, platform, backends, raw=raw,
                                              on_gpu=on_gpu, options=options)
        plans.append(Plan(case, variants, skipped))
    return plans


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _read_floor(setup, clock, progress: ItemProgress) -> dict[str, Any]:
    """``read_floor_ms``'s answer as ``read_floor_row`` keywords (a failure: its error)."""
    from .floors import read_floor_ms  # Triton kernels: imported when measured

    progress.start(f"{setup.case.label} | {READ_FLOOR}")
    try:
        ms, timing, notes = read_floor_ms(setup, clock)
        found = {"ms": ms, "timing": timing, "notes": notes}
    except Exception as exc:
        found = {"ms": None, "error": f"crashed while timed: {short_error(exc)}"}
    progress.advance()
    _free(setup.device)
    return found


def _run_plan(plan: Plan, device, clock, progress: ItemProgress, *, seed: int, rounds: bool,
              round_layers: int, timed: bool = True, parts: bool = False,
              read: Optional[dict] = None) -> list[tuple[list[int], Variant, Result]]:
    """Every variant of the plan on one setup; ``read``: a dict that gets the case's read
    floor (``_read_floor``), measured on the same setup after the variants (a launch that
    failed on the device leaves their results standing)."""
    case = plan.case
    try:
        setup = build_setup(case, device, seed=seed)
    except Exception as exc:  # e.g. out of memory: every variant of the case fails
        lengths = case.lengths(seed)
        why = f"setup failed: {type(exc).__name__}: {exc}"[:240]
        err = Result(status="failed", error=why)
        for _ in plan.variants:
            progress.advance()
        if read is not None:
            read.update(ms=None, error=why)
            progress.advance()
        _free(device)
        return [(lengths, v, err) for v in plan.variants]
    out = []
    for variant in plan.variants:
        progress.start(f"{case.label} | {variant.label}")
        result = measure_variant(variant, setup, clock, timed=timed, rounds=rounds,
                                 round_layers=round_layers)
        if parts and result.status == "ok":
            _add_parts(result, variant, setup, clock)
        out.append((setup.lengths, variant, result))
        progress.advance()
        _free(device)
    if read is not None:
        read.update(_read_floor(setup, clock, progress))
    del setup
    _free(device)
    return out


def _add_parts(result: Result, variant: Variant, setup, clock) -> None:
    """``--parts``: the step's parts into ``result.parts`` (a failure becomes a note)."""
    try:
        result.parts = measure_parts(variant, setup, clock)
    except Exception as exc:  # the timing stands; say why the parts are missing
        result.notes.append(f"parts failed ({short_error(exc)})")


def run_cases(plans: list[Plan], device, clock, bandwidth: Optional[float],
              progress: ItemProgress, *, seed: int = 0, rounds: bool = True,
              round_layers: int = 4, timed: bool = True, parts: bool = False,
              read_floor: bool = False,
              on_case: Optional[Callable[[list[dict[str, Any]]], None]] = None
              ) -> list[dict[str, Any]]:
    """Rows of every planned case: its copy floor (when ``bandwidth`` was measured), its
    read floor (``read_floor``: one more progress item per case), then one row per variant
    (skipped variants of a named backend are reported with the reason). ``timed=False``:
    check only; ``parts``: each timed variant's step parts in its row's ``parts``
    (``parts.py``); ``on_case``: called with the rows so far after each case (the CLI
    writes them, so that a run stopped part-way keeps its finished cases)."""
    rows = []
    for plan in plans:
        lengths = plan.case.lengths(seed)
        if bandwidth:
            rows.append(floor_row(plan.case, lengths, bandwidth))
        read: Optional[dict] = {} if read_floor and timed else None
        results = _run_plan(plan, device, clock, progress, seed=seed, rounds=rounds,
                            round_layers=round_layers, timed=timed, parts=parts, read=read)
        if read is not None:
            rows.append(read_floor_row(plan.case, lengths, bandwidth, **read))
        for lengths, variant, result in results:
            matmul = (matmul_tflops(device) if plan.case.compute_bound and result.step_ms
                      else None)
            rows.append(result_row(plan.case, lengths, variant, result, bandwidth, matmul))
        for name, reason in plan.skipped:
            rows.append({**case_fields(plan.case, lengths), "variant": name, "backend": name,
                         "mode": "", "kernel_library": "", "status": "unsupported",
                         "error": reason})
        if on_case is not None:
            on_case(rows)
    return rows


def run_sweep(plans: list[Plan], device, clock, bandwidth: float, progress: ItemProgress, *,
              seed: int = 0) -> list[dict[str, Any]]:
    """Rows of the prefix-length sweep (one step per variant; no rounds)."""
    rows = []
    for plan in plans:
        case = plan.case
        for lengths, variant, result in _run_plan(plan, device, clock, progress, seed=seed,
                                                  rounds=False, round_layers=0):
            floor_us = case.kv_bytes(lengths) / bandwidth * 1e6
            t = None if result.step_ms is None else result.step_ms * 1e3
            rows.append({"topk": case.topk, "prefix": case.prefix, "batch": case.batch,
                         "variant": variant.label, "status": result.status, "time_us": t,
                         "spread": result.step_spread, "floor_us": floor_us,
                         "x_floor": t / floor_us if t else None, "error": result.error})
    return rows
