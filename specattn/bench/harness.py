"""Timing, the copy-bandwidth floor and the correctness gate of ``specattn bench``.

Protocol (``docs/performance.md``): the copy bandwidth is measured in the same process a
moment before the cases; every variant is first checked against ``torch_ref`` on a sample of
requests (a variant that fails is reported as failed and not timed); times are medians of
``triton.testing.do_bench`` over a CUDA graph that runs the call once per layer, the layers'
pools rotating so the KV read per call is larger than L2 (GPU), or the median of several
``torch.utils.benchmark`` runs, with their spread (CPU). Inputs are random, never zeros.

Per variant and case:

- ``step``: one ``forward`` of one layer at the timed step (KV write included);
- ``round``: one whole draft round, metadata + ``S - 1`` steps x ``round_layers`` layers
  (decode), or metadata + one extend per layer; eagerly, and as one CUDA graph replay
  (metadata replay call + graph replay) where the backend supports graphs;
- ``engine round`` (graphs only): the round an engine feels for one draft layer, rounds back
  to back of [``init_forward_metadata_replay_cuda_graph``; replay of a graph of one layer's
  ``S - 1`` steps (extend: one call)], the layer rotating from round to round; device time
  per round, and the host time of the metadata call (``engine_round``).

The clock is an object (``WallClock``, ``CudaClock``) so tests drive the same control flow with
a fake one.
"""

from __future__ import annotations

import inspect
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..allocator import PagedKVAllocator
from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from ..fp8 import quantize, write_rows
from ..keys import BackendRequest
from ..metadata import max_draft_extend_len
from .baselines import RAW_BASELINES, DequantStep, has_module
from .cases import Case
from .options import BackendOption

__all__ = ["WallClock", "CudaClock", "HostTimer", "Setup", "Variant", "Result", "build_setup",
           "copy_bandwidth", "discover_variants", "check_variant", "measure_variant",
           "timed_step_fn", "time_per_layer", "engine_round", "time_engine_round",
           "short_error", "tolerance", "CPU_DEFAULT_BACKENDS", "ENGINE_ROUNDS",
           "ENGINE_SPANS"]

log = logging.getLogger("specattn.bench")

L2_BYTES = 50 * 2 ** 20  # H200: 50 MiB; the rotation covers three times that
# The engine round: spans of this many rounds back to back; the median span is reported.
ENGINE_ROUNDS = 50
ENGINE_SPANS = 5
CPU_DEFAULT_BACKENDS = ("torch_ref", "intel_amx")
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def tolerance(dtype: torch.dtype) -> float:
    """Max error relative to the reference's largest magnitude."""
    return _TOLERANCE.get(dtype, 2e-2)


# --- clocks --------------------------------------------------------------------------------

class WallClock:
    """Host clock through ``torch.utils.benchmark``: after one warm-up call, at least four
    blocks of calls for about ``reps`` times the warm-up's duration, longer (up to three
    times that) while the blocks still spread more than 10% (``adaptive_autorange``); the
    median per call and the spread of the blocks (interquartile range over the median,
    ``last_spread``), so a run on a busy machine shows as noisy instead of passing for a
    measurement.
    ``cpu_time=True`` counts this process's CPU time instead of wall time (steadier on a
    loaded machine; use with one torch thread). No graphs."""

    graphs = False

    def __init__(self, reps: int = 7, cpu_time: bool = False) -> None:
        self.reps = max(1, reps)
        self.name = "process CPU time, median" if cpu_time else "wall, median"
        self._now = time.process_time if cpu_time else time.perf_counter
        self.last_spread: Optional[float] = None

    def time(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of one ``fn()`` (median); sets ``last_spread``."""
        from torch.utils.benchmark import Timer

        timer = Timer(stmt="fn()", globals={"fn": fn}, timer=self._now,
                      num_threads=torch.get_num_threads())
        t0 = self._now()
        fn()
        warm = self._now() - t0
        budget = max(self.reps * warm, 1e-3)
        runs = timer.adaptive_autorange(threshold=0.1, min_run_time=budget,
                                        max_run_time=3 * budget)
        self.last_spread = runs.iqr / runs.median if runs.median > 0 else None
        return runs.median * 1e3

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        raise RuntimeError("graphs need a CUDA device")


class CudaClock:
    """CUDA: median of ``triton.testing.do_bench`` (device events); graphs captured on the
    current device."""

    name = "do_bench median"
    graphs = True
    last_spread: Optional[float] = None  # do_bench's median only

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 200) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def time(self, fn: Callable[[], Any]) -> float:
        import triton

        return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                             return_mode="median"))

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Capture ``fn`` (already run once eagerly) and return the replay."""
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay

    def span(self, fn: Callable[[], Any]) -> float:
        """Milliseconds between device events recorded before and after one ``fn()`` on an
        idle device: its device work, and the time the device waits for the host."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))


class HostTimer:
    """Host time of calls: ``now()`` (``time.perf_counter``) read around each ``call(fn)``;
    nothing else (no device synchronisation) is inside the interval."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.seconds: list[float] = []

    def call(self, fn: Callable[[], Any]) -> Any:
        t0 = self.now()
        out = fn()
        self.seconds.append(self.now() - t0)
        return out

    def clear(self) -> None:
        self.seconds.clear()

    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3


def copy_bandwidth(device: torch.device, clock) -> float:
    """Bytes read + written per second of a large copy on ``device`` (2 GiB on a GPU, 128 MiB
    on the CPU), timed with ``clock``."""
    numel = 2 ** 29 if device.type == "cuda" else 2 ** 25
    # Not zeros (some memory systems compress them); randn is slow on a CPU, a constant is not.
    src = (torch.randn(numel, device=device) if device.type == "cuda"
           else torch.full((numel,), 1.5))
    dst = torch.empty_like(src)
    ms = clock.time(lambda: dst.copy_(src))
    return 2 * numel * 4 / (ms * 1e-3)


# --- the data of one case --------------------------------------------------------------------

@dataclass
class Setup:
    """A case made concrete: pools with random KV, the batch, inputs and layers.

    inputs: per decode step (or once for extend) ``(q, k, v)`` of ``case.lanes`` rows.
    sample: request indices the correctness check compares (first, last, longest).
    """

    case: Case
    runner: DraftRunner
    batch: Any
    lengths: list[int]
    inputs: list[tuple]
    layers: list[AttentionLayer]
    sample: list[int]

    @property
    def device(self) -> torch.device:
        return self.runner.device


def _num_layers(case: Case, lengths: list[int], device: torch.device,
                max_layers: Optional[int]) -> int:
    per_layer = max(sum(lengths) * case.row_bytes, 1)
    layers = max(2, min(12, -(-3 * L2_BYTES // per_layer)))
    if device.type != "cuda":
        layers = min(layers, 2)
    return min(layers, max_layers) if max_layers else layers


def _random_inputs(case: Case, rows: int, device: torch.device, gen: torch.Generator):
    dt = case.dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    a, b, c = case.shape
    if case.model == "mla":
        return randn(rows, a, b + c), randn(rows, b + c), None
    return randn(rows, a, c), randn(rows, b, c), randn(rows, b, c)


def build_setup(case: Case, device: torch.device | str, *, seed: int = 0,
                max_layers: Optional[int] = None) -> Setup:
    """Runner, pools (random), requests (``PagedKVAllocator``), batch and inputs of ``case``."""
    device = torch.device(device)
    lengths = case.lengths(seed)
    layers = _num_layers(case, lengths, device, max_layers)
    P = case.page_size
    # The draft round's slots: with P > 1 and K > 1 each lane owns a copy of the partial last
    # page, so the bound is metadata's, not K * S.
    ext = max_draft_extend_len(case.topk, case.steps, P) if case.kind == "decode" else 0
    pages = sum(-(-(n + ext) // P) for n in lengths) + 2
    max_ctx = max(lengths) + ext + P
    kw = dict(num_layers=layers, num_slots=pages * P, max_reqs=case.batch,
              max_context_len=max_ctx, page_size=P, dtype=case.dtype, device=device,
              kv_cache_dtype=case.kv_cache_dtype)
    a, b, c = case.shape
    runner = (DraftRunner.mla(a, b, c, **kw) if case.model == "mla"
              else DraftRunner.mha(a, b, c, **kw))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if case.model == "mla":
        pools, scales = runner.kv_buffer, [case.k_scale] * layers
    else:
        pools = runner.k_buffer + runner.v_buffer
        scales = [case.k_scale] * layers + [case.v_scale] * layers
    every_slot = torch.arange(runner.num_slots, device=device)
    for pool, kv_scale in zip(pools, scales):
        values = torch.randn(pool.shape, generator=gen, device=device)
        if runner.fp8:  # stored as runner.write_kv stores KV
            write_rows(pool, every_slot, quantize(values, kv_scale, pool.dtype))
        else:
            pool.copy_(values)
    alloc = PagedKVAllocator(runner)
    reqs = [alloc.new_request() for _ in lengths]
    rpi = torch.tensor(reqs, dtype=torch.int64, device=device)
    if case.kind == "decode":
        for req, n in zip(reqs, lengths):
            alloc.extend(req, n)
        seq_lens = alloc.seq_lens(reqs)
        loc = alloc.alloc_draft(rpi, case.topk, case.steps)
        # With the host copy of the lengths an engine keeps (SGLang's seq_lens_cpu).
        batch = DraftBatch(rpi, seq_lens, loc, seq_lens_cpu=seq_lens.cpu())
        inputs = [_random_inputs(case, case.lanes, device, gen) for _ in range(case.steps)]
    else:
        new = []
        for req, n in zip(reqs, lengths):
            alloc.extend(req, n - case.extend_len)
            new.append(alloc.extend(req, case.extend_len))
        seq_lens = alloc.seq_lens(reqs)
        ext = torch.full((case.batch,), case.extend_len, device=device)
        batch = DraftExtendBatch(rpi, seq_lens, ext, torch.cat(new),
                                 seq_lens_cpu=seq_lens.cpu(), extend_lens_cpu=ext.cpu())
        inputs = [_random_inputs(case, case.lanes, device, gen)]
    head = c if case.model == "mha" else 192  # MLA: qk_nope + rope of the unabsorbed head
    scale = head ** -0.5
    longest = max(range(case.batch), key=lambda i: lengths[i])
    sample = sorted({0, case.batch - 1, longest})
    return Setup(case, runner, batch, lengths, inputs,
                 [AttentionLayer(i, scale, k_scale=case.k_scale, v_scale=case.v_scale)
                  for i in range(layers)], sample)


# --- variants --------------------------------------------------------------------------------

@dataclass
class Variant:
    """One thing to time: a registered backend in one mode, a raw-library baseline, or a
    backend's ``dequant`` baseline (FP8 cases)."""

    label: str
    backend: str
    mode: str  # "shared", "per-branch", "default", "option", "dequant" or "raw"
    kernel_library: str
    make: Callable[[Setup], Any]
    graphs: bool = False  # supports the CUDA-graph protocol
    raw: bool = False


def _request(case: Case) -> BackendRequest:
    a, b, c = case.shape
    head_dim = b + c if case.model == "mla" else c
    return BackendRequest(kind=case.kind, mla=case.model == "mla", topk=case.topk,
                          num_steps=case.steps, page_size=case.page_size, dtype=case.dtype,
                          head_dim=head_dim, kv_cache_dtype=case.kv_cache_dtype)


def _has_mode(cls: type) -> bool:
    return "mode" in inspect.signature(cls.__init__).parameters


def _default_mode(cls: type) -> Any:
    return inspect.signature(cls.__init__).parameters["mode"].default


def _builder(cls: type, case: Case, **kw) -> Callable[[DraftRunner], Any]:
    """``runner -> cls(runner, ...)`` for ``case`` (decode: its ``topk`` and steps)."""
    if case.kind == "decode":
        return lambda runner: cls(runner, case.topk, case.steps, **kw)
    if "max_extend_len" in inspect.signature(cls.__init__).parameters:
        kw = dict(kw, max_extend_len=case.extend_len)  # the graph grid's bound (S + 1 slots)
    return lambda runner: cls(runner, **kw)


def _maker(cls: type, case: Case, **kw) -> Callable[[Setup], Any]:
    build = _builder(cls, case, **kw)
    return lambda s: build(s.runner)


def _dequant_variant(info, cls: type, case: Case, platform) -> Optional[Variant]:
    """``<name>/dequant`` of an FP8 case (``baselines.DequantStep``) when ``cls`` serves the
    case with pools in the activation dtype; its shared mode where it has modes."""
    if cls.validate(_request(case.with_(kv_cache_dtype="auto")), platform):
        return None
    kw = {"mode": "shared"} if case.kind == "decode" and _has_mode(cls) else {}
    build = _builder(cls, case, **kw)
    return Variant(f"{info.name}/dequant", info.name, "dequant", info.kernel_library,
                   lambda s: DequantStep(s.runner, build), bool(cls.supports_cuda_graph))


def discover_variants(case: Case, platform, names: Optional[list[str]] = None,
                      raw: bool = True, on_gpu: Optional[bool] = None,
                      options: Sequence[BackendOption] = (),
                      ) -> tuple[list[Variant], list[tuple[str, str]]]:
    """Variants that can run ``case`` here, and ``(name, reason)`` for those that cannot.

    names: backends to include (registered names or aliases, or a raw key such as
    ``flashinfer-raw``); ``None``: every backend available here (on the CPU, ``torch_ref``
    and ``intel_amx``). On a GPU ``torch_ref`` is the correctness reference only and is
    timed only when named. Backends with a ``mode`` constructor keyword also run
    ``mode="per-branch"``; on an FP8 case each also runs ``<name>/dequant`` (mode
    ``dequant``, ``baselines.DequantStep``) where it serves the bf16 twin, and the raw
    baselines (bf16 pools only) do not run. on_gpu: whether the tensors live on a GPU
    (default: the platform's device is not the CPU). options: ``--option`` variants (mode
    ``option``), added for the classes of their backend that take their keywords, whether
    or not the backend's own variants run.
    """
    from ..listing import list_backends

    on_gpu = platform.device != "cpu" if on_gpu is None else on_gpu
    wanted = None if names is None else set(names)
    variants: list[Variant] = []
    skipped: list[tuple[str, str]] = []
    infos = list_backends(kind=case.kind, platform=platform)
    # A name with several flavours (fa3/fa4: cuda and musa) is one backend here: the flavours
    # that cannot run on this platform are not "not run" rows when another flavour runs.
    running = {i.name for i in infos if i.runs_here and case.model in i.models}
    flavours: dict[str, list[tuple[str, str]]] = {}  # name -> (flavour, why it cannot run)
    for info in infos:
        cls = info.backend
        if cls is None or info.flavour == "dispatcher":
            continue
        if not info.runs_here and info.name in running:
            continue
        keys = {info.name, *info.aliases}
        own = _runs_by_default(info, cls, wanted, on_gpu)
        opts = [o for o in options if o.backend in keys and o.fits(cls)]
        if not (own or opts) or case.model not in info.models:
            continue  # not asked for, or the other flavour of this backend serves the model
        reasons = [] if info.runs_here else [info.reason]
        reasons = reasons or cls.validate(_request(case), platform)
        if reasons:
            if wanted is not None or info.runs_here or opts:
                flavours.setdefault(info.name, []).append((info.flavour, "; ".join(reasons)))
            continue
        graphs = bool(cls.supports_cuda_graph)
        if own and case.kind == "decode" and _has_mode(cls):
            # The name's row is the backend as an engine gets it: its default mode (fa3/fa4:
            # "auto", routed per round), labelled "shared" when that default is shared.
            default = _default_mode(cls)
            variants.append(Variant(info.name, info.name,
                                    "shared" if default == "shared" else "default",
                                    info.kernel_library, _maker(cls, case), graphs))
            variants.append(Variant(f"{info.name}/per-branch", info.name, "per-branch",
                                    info.kernel_library, _maker(cls, case, mode="per-branch"),
                                    graphs))
        elif own:
            variants.append(Variant(info.name, info.name, "default", info.kernel_library,
                                    _maker(cls, case), graphs))
        dequant = _dequant_variant(info, cls, case, platform) if own and case.fp8 else None
        variants += [dequant] if dequant else []
        variants += [Variant(o.label, info.name, "option", info.kernel_library,
                             _maker(cls, case, **o.kwargs_for(cls)), graphs) for o in opts]
    # One row per name: a backend none of whose flavours runs the case says why for each.
    skipped += [(name, found[0][1] if len(found) == 1 else
                 "; ".join(f"{flavour}: {why}" for flavour, why in found))
                for name, found in flavours.items()]
    if raw and case.kind == "decode" and case.model == "mha":
        for key, cls, module, device in RAW_BASELINES:
            if wanted is not None and not {key, "raw"} & wanted:
                continue
            if (device == "cuda") != on_gpu:
                continue
            if case.fp8:
                if wanted is not None:
                    skipped.append((key, "reads pools of the activation dtype only, not "
                                    f"kv_cache_dtype {case.kv_cache_dtype!r}"))
                continue
            if module != "torch" and not has_module(module):
                skipped.append((key, f"needs the '{module}' package"))
                continue
            variants.append(Variant(cls.label, key, "raw", module,
                                    lambda s, cls=cls: cls(s.runner, case.topk, case.steps),
                                    raw=True))
    if wanted is not None:
        known = {v.backend for v in variants} | {n for n, _ in skipped}
        for name in sorted(wanted - known - {"raw"}):
            if not any(name in (v.label, v.backend) for v in variants):
                skipped.append((name, "not a backend of this kind/model that is registered"))
    return variants, skipped


def _runs_by_default(info, cls: type, wanted: Optional[set], on_gpu: bool) -> bool:
    """Whether the backend's own variants run: named, or (nothing named) a default here."""
    if wanted is not None:
        return bool({info.name, *info.aliases} & wanted)
    if not cls.auto_eligible:
        return False  # model-specific math (dsa, dsv4): timed only when named
    if on_gpu:
        return info.name != "torch_ref"
    return info.name in CPU_DEFAULT_BACKENDS


# --- correctness -----------------------------------------------------------------------------

def _sub_decode_batch(batch: DraftBatch, sample: list[int]) -> DraftBatch:
    idx = torch.tensor(sample, device=batch.seq_lens.device)
    return DraftBatch(batch.req_pool_indices[idx], batch.seq_lens[idx],
                      batch.out_cache_loc[idx], None)


def _rows_of(sample: list[int], width: int, device) -> torch.Tensor:
    """Query rows of the sampled requests when each request owns ``width`` rows."""
    idx = torch.tensor(sample, device=device)
    return (idx[:, None] * width + torch.arange(width, device=device)).reshape(-1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in float32 (``inf`` when ``out`` is not finite)."""
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def check_variant(variant: Variant, setup: Setup) -> float:
    """Run ``variant`` on layer 0 (decode: steps ``0 .. timed_step``) and compare the sampled
    requests with ``torch_ref``. Returns the relative error; raises on a crash."""
    from ..backends.torch_ref import reference_decode, reference_extend

    case, layer = setup.case, setup.layers[0]
    backend = variant.make(setup)
    backend.init_forward_metadata(setup.batch)
    if case.kind == "decode":
        for step in range(case.timed_step + 1):
            out = backend.forward(step, layer, *setup.inputs[step])
        q = setup.inputs[case.timed_step][0]
        rows = _rows_of(setup.sample, case.topk, q.device)
        ref = reference_decode(setup.runner, layer, q[rows],
                               _sub_decode_batch(setup.batch, setup.sample), case.timed_step)
    else:
        out = backend.forward(layer, *setup.inputs[0])
        q = setup.inputs[0][0]
        rows = _rows_of(setup.sample, case.extend_len, q.device)
        b = setup.batch
        idx = torch.tensor(setup.sample, device=q.device)
        sub = DraftExtendBatch(b.req_pool_indices[idx], b.seq_lens[idx], b.extend_lens[idx],
                               b.out_cache_loc[rows])
        ref = reference_extend(setup.runner, layer, q[rows], sub)
    return relative_error(out[rows], ref)


# --- timing ----------------------------------------------------------------------------------

@dataclass
class Result:
    """What ``measure_variant`` found (times in ms; ``None``: not measured)."""

    status: str = "ok"  # ok | failed | checked (passed the check, not timed)
    error: str = ""
    max_err: Optional[float] = None
    step_ms: Optional[float] = None
    step_spread: Optional[float] = None  # interquartile range / median of the step's runs
    step_timing: str = ""
    round_eager_ms: Optional[float] = None
    round_graph_ms: Optional[float] = None
    round_layers: int = 0
    engine_round_ms: Optional[float] = None  # engine_round: device span per round
    engine_host_ms: Optional[float] = None  # and the replay metadata call's host time
    notes: list[str] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)  # --parts (parts.py)


def short_error(exc: BaseException) -> str:
    """``Type: first line`` of an exception, at most 240 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


def _step_call(backend, setup: Setup):
    case = setup.case
    if case.kind == "decode":
        step = case.timed_step
        q, k, v = setup.inputs[step]
        return lambda layer: backend.forward(step, layer, q, k, v)
    q, k, v = setup.inputs[0]
    return lambda layer: backend.forward(layer, q, k, v)


def timed_step_fn(backend, setup: Setup) -> Callable[[], None]:
    """With the round's metadata set: run the steps before the timed one (decode), and
    return a call of the timed step on every layer in turn (the KV rotation)."""
    case = setup.case
    if case.kind == "decode":
        for step in range(case.timed_step):  # the history before the timed step
            backend.forward(step, setup.layers[0], *setup.inputs[step])
    call = _step_call(backend, setup)
    layers = setup.layers

    def all_layers():
        for layer in layers:
            call(layer)
    return all_layers


def time_per_layer(clock, all_layers: Callable[[], None], layers: int,
                   device: torch.device) -> tuple[float, str, list[str]]:
    """Milliseconds per layer of ``all_layers`` (one call per rotating layer): a replay of
    one CUDA graph of it where the clock has graphs (eagerly if the capture fails), else
    the clock's own timing; how it was timed; notes."""
    notes: list[str] = []
    if clock.graphs:
        try:
            all_layers()  # plans and compiles outside the capture
            replay = clock.graph(all_layers)
            return clock.time(replay) / layers, "graph", notes
        except Exception as exc:  # report, then time eagerly
            notes.append(f"graph capture failed ({short_error(exc)}); eager timing")
            if device.type == "cuda":
                torch.cuda.synchronize()
    return clock.time(all_layers) / layers, "eager" if clock.graphs else clock.name, notes


def time_step(variant: Variant, setup: Setup, clock) -> tuple[float, str, list[str]]:
    """Milliseconds of one step of one layer (rotating layers), how it was timed, notes."""
    case = setup.case
    backend = variant.make(setup)
    if clock.graphs and variant.graphs:  # the backend's own graph protocol (fixed buffers)
        backend.init_cuda_graph_state(case.batch, case.lanes)
        backend.init_forward_metadata_capture_cuda_graph(setup.batch)
    else:
        backend.init_forward_metadata(setup.batch)
    all_layers = timed_step_fn(backend, setup)
    return time_per_layer(clock, all_layers, len(setup.layers), setup.device)


def _round_fn(backend, setup: Setup, layers: list[AttentionLayer], metadata: Callable):
    case = setup.case

    def run():
        metadata()
        if case.kind == "decode":
            for step in range(case.steps - 1):
                q, k, v = setup.inputs[step]
                for layer in layers:
                    backend.forward(step, layer, q, k, v)
        else:
            q, k, v = setup.inputs[0]
            for layer in layers:
                backend.forward(layer, q, k, v)
    return run


def time_round(variant: Variant, setup: Setup, clock, round_layers: int,
               ) -> tuple[float, Optional[float], list[str]]:
    """One whole round: eager ms, and graph ms (metadata replay + graph replay) or None."""
    layers = setup.layers[:round_layers]
    notes: list[str] = []
    backend = variant.make(setup)
    eager = clock.time(_round_fn(backend, setup, layers,
                                 lambda: backend.init_forward_metadata(setup.batch)))
    graph = None
    if clock.graphs and variant.graphs:
        try:
            gb = variant.make(setup)
            case = setup.case
            gb.init_cuda_graph_state(case.batch, case.lanes)
            gb.init_forward_metadata_capture_cuda_graph(setup.batch)
            body = _round_fn(gb, setup, layers, lambda: None)
            body()  # warm-up outside the capture
            replay = clock.graph(body)

            def replayed():
                gb.init_forward_metadata_replay_cuda_graph(setup.batch, case.batch)
                replay()

            graph = clock.time(replayed)
        except Exception as exc:
            notes.append(f"round graph failed ({short_error(exc)})")
    return eager, graph, notes


def engine_round(metadata: Callable[[], Any], replays: Sequence[Callable[[], Any]], clock, *,
                 rounds: int = ENGINE_ROUNDS, spans: int = ENGINE_SPANS,
                 now: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """The round an engine feels: ``rounds`` times [``metadata()``; the next of ``replays``]
    back to back, inside one ``clock.span`` (device events around the whole loop), host time
    (``HostTimer``) around each ``metadata()``. After one loop as warm-up, ``spans`` loops;
    returns the median over the loops of span / rounds and the median host time of the
    metadata call, in ms."""
    host = HostTimer(now)

    def loop():
        for i in range(rounds):
            host.call(metadata)
            replays[i % len(replays)]()
    loop()
    host.clear()
    per_round = [clock.span(loop) / rounds for _ in range(spans)]
    return statistics.median(per_round), host.median_ms()


def time_engine_round(variant: Variant, setup: Setup, clock, **kw) -> tuple[float, float]:
    """``engine_round`` of ``variant`` on ``setup``: a backend in the graph protocol, one
    captured graph of one layer's ``S - 1`` steps (extend: one call) per rotating layer, the
    replay metadata call (``init_forward_metadata_replay_cuda_graph``) before each replay.
    Returns (round ms, host ms)."""
    case = setup.case
    backend = variant.make(setup)
    backend.init_cuda_graph_state(case.batch, case.lanes)
    backend.init_forward_metadata_capture_cuda_graph(setup.batch)
    replays = []
    for layer in setup.layers:
        body = _round_fn(backend, setup, [layer], lambda: None)
        body()  # warm-up outside the capture
        replays.append(clock.graph(body))

    def metadata():
        backend.init_forward_metadata_replay_cuda_graph(setup.batch, case.batch)
    return engine_round(metadata, replays, clock, **kw)


def measure_variant(variant: Variant, setup: Setup, clock, *, timed: bool = True,
                    rounds: bool = True, round_layers: int = 4) -> Result:
    """Check, then time one variant on one case. Never raises: failures become the result."""
    res = Result(round_layers=min(round_layers, len(setup.layers)))
    try:
        res.max_err = check_variant(variant, setup)
    except Exception as exc:
        log.debug("check of %s failed", variant.label, exc_info=True)
        return Result(status="failed", error=f"crashed in the check: {short_error(exc)}")
    tol = tolerance(setup.case.dtype)
    if not res.max_err <= tol:
        res.status = "failed"
        res.error = (f"wrong result: max error {res.max_err:.3g} of the reference's largest "
                     f"value (tolerance {tol:g})")
        return res
    if not timed:
        res.status = "checked"
        return res
    try:
        res.step_ms, res.step_timing, notes = time_step(variant, setup, clock)
        res.step_spread = getattr(clock, "last_spread", None)
        res.notes += notes
        if rounds and not variant.raw:
            res.round_eager_ms, res.round_graph_ms, notes = time_round(
                variant, setup, clock, res.round_layers)
            res.notes += notes
            if clock.graphs and variant.graphs:
                try:
                    res.engine_round_ms, res.engine_host_ms = time_engine_round(
                        variant, setup, clock)
                except Exception as exc:
                    res.notes.append(f"engine round failed ({short_error(exc)})")
    except Exception as exc:
        log.debug("timing of %s failed", variant.label, exc_info=True)
        res.status, res.error = "failed", f"crashed while timed: {short_error(exc)}"
    return res
