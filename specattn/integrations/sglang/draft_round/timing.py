"""Timing of a draft round: the graph runner's ``execute``, each step's attention call, and
stock SGLang against the plugin (``time_pair``)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from .checks import UPSTREAM, compare
from .fixture import Fixture, RoundCase
from .runs import (DraftModel, Record, _sync, capture_graph, execute_tree, make_container,
                   run_eager)


def time_graph_round(fx: Fixture, graph, inputs: dict, reps: int = 30,
                     warmup: int = 3) -> dict:
    """``execute`` (the runner's host preparation + replay), median over ``reps``: host wall
    time to completion (perf_counter, with a synchronize) and the span between CUDA events
    recorded around it."""
    batch = fx.batch_of(inputs)
    walls, spans = [], []
    with torch.no_grad():
        for i in range(warmup + reps):
            _sync(fx.device)
            if fx.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            graph.execute(batch)
            if fx.device == "cuda":
                end.record()
            _sync(fx.device)
            wall = time.perf_counter() - t0
            if i >= warmup:
                walls.append(wall * 1e6)
                if fx.device == "cuda":
                    spans.append(start.elapsed_time(end) * 1e3)
    return {"round_wall_us": _median(walls), "round_event_us": _median(spans)}


def time_steps(fx: Fixture, rec: Record, reps: int = 20) -> list[float]:
    """Each step's attention call (``RadixAttention`` with the step's backend, the recorded
    inputs and batch), eagerly: median microseconds per call (CUDA events, or wall time)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    out = []
    with torch.no_grad():
        for backend, q, k, v, kw, fb in rec.steps_inputs:
            def call():
                with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
                    fx.layer(q, k, v, fb, **kw)
            call()
            times = []
            for _ in range(reps):
                _sync(fx.device)
                if fx.device == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    s.record()
                    call()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) * 1e3)
                else:
                    t0 = time.perf_counter()
                    call()
                    times.append((time.perf_counter() - t0) * 1e6)
            out.append(_median(times))
    return out


def served_by(container) -> str:
    """``specattn NAME (Class)`` for the plugin's container, else SGLang's class."""
    backend = getattr(container, "specattn_backend", None)
    if backend is None:
        return f"SGLang {type(container).__name__}"
    return f"specattn {type(backend).name} ({type(backend).__name__})"


def time_pair(fx: Fixture, case: RoundCase, backend: str, tol: float, reps: int = 30,
              free: Callable[[], None] = lambda: None) -> dict:
    """SGLang's draft round under the name ``backend``, stock and through the plugin
    (``SPECATTN_SGLANG=1``): per side an eager round (checked, and each step's attention
    timed), then the graph runner captured without records, one ``execute`` (its tree) and
    ``time_graph_round``. Returns ``{"stock": side or None, "stock_error": str, "specattn":
    side, "verdict": compare(stock, specattn) or None, "graph_tokens_equal": int,
    "upstream": str}``; a side: ``{"served_by", "round_wall_us", "round_event_us", "step_us":
    [...]}``. SGLang refusing the case is ``stock_error``; a stock backend of ``UPSTREAM`` is
    not compared (``upstream``: why); specattn failing raises."""
    from ....bench.harness import short_error
    settings = fx.use(case, backend)
    model = DraftModel(fx)
    inputs = fx.inputs()
    out: dict = {"stock": None, "stock_error": "", "verdict": None, "graph_tokens_equal": 0,
                 "upstream": ""}
    kept = {}
    saved = fx.snapshot()  # each side starts from the same pools (a capture writes KV too)
    for who, env in (("stock", None), ("specattn", {"SPECATTN_SGLANG": "1"})):
        fx.restore(saved)
        try:
            container = make_container(fx, env)
            if who == "stock" and type(container).__name__ in UPSTREAM:
                out["upstream"] = UPSTREAM[type(container).__name__]["eager"][1]
            eager = run_eager(fx, container, settings, model, inputs)
            steps = time_steps(fx, eager, reps=max(1, reps * 2 // 3))
            eager.steps_inputs = []  # the recorded batches hold the step backends
            graph = capture_graph(fx, container, settings, model)  # no records in the graph
            tree = execute_tree(fx, graph, inputs)
            side = {"served_by": served_by(container), "step_us": steps,
                    **time_graph_round(fx, graph, inputs, reps=reps, warmup=min(3, reps))}
            kept[who] = (eager, tree)
            out[who] = side
            del graph, container
        except Exception as exc:
            if who == "specattn":
                raise
            out["stock_error"] = short_error(exc)
        finally:
            free()
    if "stock" in kept and not out["upstream"]:
        (ref, ref_tree), (got, tree) = kept["stock"], kept["specattn"]
        out["verdict"] = compare(ref, got, case.topk, tol)
        out["graph_tokens_equal"] = sum(
            all(torch.equal(x[b], y[b]) for x, y in zip(ref_tree, tree) if x is not None)
            for b in range(fx.batch))
    return out


def _median(values: list) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
