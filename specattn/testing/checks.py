"""The bodies of the kit's cases: numerics, pool writes, engine-style inputs, CUDA graphs,
determinism and refusals.

Every body takes a ``Session`` (the backend under test, device, seeds, shape choice) and a
``Case`` and returns a short detail string, or raises ``CaseFailed`` / ``CaseSkipped``. The
expected result is always the reference (``torch_ref``'s ``reference_decode`` /
``reference_extend``) over the kit's own copy of the pools, into which the kit writes each
call's new KV itself: a backend that forgets the write, writes elsewhere or reads a stale slot
differs from it. For a quantized pool (FP8 with the layer's ``k_scale`` / ``v_scale``, or a
DeepSeek byte layout) the kit's copy holds the codes ``runner.write_kv`` gives, compared bit
for bit, and the reference is float64 attention over that copy dequantized.
"""

from __future__ import annotations

import contextlib
import copy
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from .. import metadata
from ..backends.torch_ref import reference_decode, reference_extend
from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from ..errors import InvalidInputError, SpecAttnError
from ..fp8 import Scale, dequantize
from .compare import output_mismatch, pool_mismatch
from .outcomes import CaseFailed, CaseSkipped
from .rounds import (DecodeRound, EngineStyle, ExtendRound, ModelShape, RoundMaker, pools_of,
                     random_qkv, shadow_runner)
from .target import Target

__all__ = ["Case", "Session", "CaseFailed", "CaseSkipped", "FP8_SCALES", "FP8_SCALE_ROUNDS"]

NUM_STEPS = 3
# (k_scale, v_scale) of the FP8 cases; a graph case's rounds (capture, replays) change them.
FP8_SCALES = (0.37, 1.9)
FP8_SCALE_ROUNDS = (FP8_SCALES, (0.61, 1.3), (1.7, 0.45))


@dataclass(frozen=True)
class Case:
    """One planned case. ``id`` is what reports and ``known_limits`` patterns use."""

    id: str
    kind: str
    model: str
    body: Callable[["Session", "Case"], str]
    dtype: torch.dtype = torch.float32
    topk: int = 1
    page_size: int = 1
    tree_mode: str = "lane"
    kv_cache_dtype: str = "auto"
    params: dict = field(default_factory=dict, compare=False, hash=False)


def _shape_candidates(model: str, device: torch.device, one_kv: bool,
                      narrow_v: bool) -> list[ModelShape]:
    """``one_kv``: MHA with one KV head; ``narrow_v``: MHA values half the keys' width (a
    backend that returns ``q``'s shape, or reads values at the key width, fails it)."""
    if model == "mha":
        q, kv = (4, 1) if one_kv else (4, 2)
        dims = (16, 64, 128) if device.type == "cpu" else (64, 128)
        if device.type != "cpu":
            q = 8
        return [ModelShape("mha", (q, kv, d), d // 2 if narrow_v else None) for d in dims]
    small = [(4, 32, 16), (4, 32, 0)]
    big = [(16, 512, 64), (16, 512, 0)]
    order = small + big if device.type == "cpu" else big + small
    return [ModelShape("mla", h) for h in order]


class Session:
    """The backend under test plus what the cases share: device, seeds, chosen shapes."""

    def __init__(self, target: Target, seed: int = 0, level: str = "quick"):
        self.target = target
        self.device = target.device
        self.seed = seed
        self.level = level
        self._shapes: dict[tuple, ModelShape] = {}

    # --- helpers for the bodies ----------------------------------------------------------------

    def generator(self, case: Case, salt: str = "") -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003
                                             + zlib.crc32((case.id + salt).encode()))

    def cls(self, case: Case) -> type:
        found = self.target.class_for(case.kind, case.model)
        if isinstance(found, str):
            raise CaseSkipped(found)
        return found

    def construct(self, case: Case, runner: DraftRunner, *, topk: Optional[int] = None,
                  num_steps: int = NUM_STEPS):
        return self.target.construct(self.cls(case), runner, case.kind,
                                     case.topk if topk is None else topk, num_steps,
                                     case.tree_mode)

    def shape(self, case: Case) -> ModelShape:
        """The first candidate shape the class accepts for ``case`` (probed by building it on
        a tiny runner; ``case.params`` ``one_kv`` / ``narrow_v`` pick the candidates), cached
        per request."""
        one_kv, narrow_v = case.params.get("one_kv", False), case.params.get("narrow_v", False)
        key = (case.kind, case.model, case.dtype, case.page_size, case.topk, case.tree_mode,
               case.kv_cache_dtype, one_kv, narrow_v)
        if key in self._shapes:
            return self._shapes[key]
        reasons = []
        self.cls(case)  # no class for the case: skipped before any shape is tried
        for shape in _shape_candidates(case.model, self.device, one_kv, narrow_v):
            try:
                maker = self.maker(case, shape, max_tokens=4, max_reqs=2)
                self.construct(case, maker.runner)
            except (SpecAttnError, CaseSkipped) as exc:  # CaseSkipped: an option refused
                reasons.append(f"{shape.label()}: {exc}")
                continue
            self._shapes[key] = shape
            return shape
        raise CaseSkipped("the backend accepts none of the kit's shapes: "
                          + " | ".join(reasons[-2:]))

    def maker(self, case: Case, shape: ModelShape, *, max_tokens: int, max_reqs: int = 5,
              style: EngineStyle = EngineStyle(), gen: Optional[torch.Generator] = None,
              ) -> RoundMaker:
        k_scale, v_scale = case.params.get("scales", (1.0, 1.0))
        return RoundMaker(shape, case.dtype, self.device, case.page_size, max_tokens,
                          max_reqs, gen or self.generator(case, "pools"),
                          kv_cache_dtype=case.kv_cache_dtype, style=style, k_scale=k_scale,
                          v_scale=v_scale)

    @contextlib.contextmanager
    def value_checks(self) -> Iterator[None]:
        """Checks of tensor values run on the CPU always; on a device, only in debug mode."""
        if self.device.type == "cpu":
            yield
            return
        old = os.environ.get("SPECATTN_DEBUG_CHECKS")
        os.environ["SPECATTN_DEBUG_CHECKS"] = "1"
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("SPECATTN_DEBUG_CHECKS", None)
            else:
                os.environ["SPECATTN_DEBUG_CHECKS"] = old


# --- expected pools and references ---------------------------------------------------------------


def _dense(shadow: DraftRunner, layer: AttentionLayer) -> DraftRunner:
    """The runner the reference reads: ``shadow`` itself, or for a quantized pool (an FP8
    layout, or FP8 codes with ``layer``'s scales) its pools dequantized to float64 (the
    reference is "dequantize, then exact attention")."""
    layout = shadow.kv_layout
    if layout is None and not shadow.fp8:
        return shadow
    dense = copy.copy(shadow)
    dense.kv_layout, dense.kv_cache_dtype = None, "auto"
    if layout is not None:
        dense.kv_buffer = [layout.read_all(p).double() for p in shadow.kv_buffer]
    elif shadow.use_mla_backend:
        dense.kv_buffer = [dequantize(p, layer.k_scale, torch.float64)
                           for p in shadow.kv_buffer]
    else:
        dense.k_buffer = [dequantize(p, layer.k_scale, torch.float64) for p in shadow.k_buffer]
        dense.v_buffer = [dequantize(p, layer.v_scale, torch.float64) for p in shadow.v_buffer]
    return dense


def _check_pools(runner: DraftRunner, shadow: DraftRunner, written: torch.Tensor, where: str,
                 exempt: Optional[torch.Tensor] = None) -> None:
    for (name, got), (_, want) in zip(pools_of(runner), pools_of(shadow)):
        msg = pool_mismatch(name, got, want, written, exempt)
        if msg:
            raise CaseFailed(f"{where}: {msg}")


def _layers(shape: ModelShape, logit_cap: float = 0.0, both: bool = False,
            scales: tuple[Scale, Scale] = (1.0, 1.0)) -> list[AttentionLayer]:
    """Layer 1 (a backend that ignores ``layer_id`` reads layer 0's pool and differs); with
    ``both``, layer 1 then layer 0 at every step (pools of one layer must not leak into the
    other). ``scales``: their ``(k_scale, v_scale)``."""
    return [AttentionLayer(i, shape.scaling, logit_cap, *scales)
            for i in ((1, 0) if both else (1,))]


def _forward(fn: Callable[[], torch.Tensor], what: str) -> torch.Tensor:
    try:
        out = fn()
    except SpecAttnError as exc:  # (soft-cap cases of a class without one are not run)
        raise CaseFailed(f"{what}: refused a valid input: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor):
        raise CaseFailed(f"{what}: returned {type(out).__name__}, expected a tensor")
    return out.clone()  # graph backends may return a static buffer


# --- decode ------------------------------------------------------------------------------------------


def decode_lengths(page_size: int, ragged: bool) -> list[int]:
    """Prefix lengths spanning several pages: ragged (with ``L = 1``) or uniform."""
    if page_size > 16:
        return [1, page_size + 5, 2 * page_size + 9] if ragged else [page_size + 8] * 2
    return [1, 13, 40] if ragged else [24, 24]


def _decode_maker(s: Session, case: Case, shape: ModelShape, lens_sets: list[list[int]],
                  style: EngineStyle = EngineStyle(), max_reqs: int = 5,
                  num_steps: int = NUM_STEPS) -> RoundMaker:
    extra = metadata.max_draft_extend_len(case.topk, num_steps, case.page_size)
    longest = max(max(lens) for lens in lens_sets)
    return s.maker(case, shape, max_tokens=longest + extra, max_reqs=max_reqs, style=style)


def _fill_parents(rnd: DecodeRound, step: int, rows: slice = slice(None)) -> None:
    if rnd.parents_plan is not None and step > 0:
        rnd.batch.parents[step, rows] = rnd.parents_plan[step].to(rnd.batch.parents.device)


def _poison_row(k: torch.Tensor, v: Optional[torch.Tensor], row: int) -> None:
    """A non-finite new key (and value) in ``row``: only queries that attend it may see it."""
    k[row] = float("nan")
    if v is not None:
        v[row] = float("nan")


def _free_rows(ref: torch.Tensor) -> torch.Tensor:
    """Rows whose reference is non-finite: they attend a poisoned key on purpose."""
    return ~torch.isfinite(ref.float()).reshape(ref.shape[0], -1).all(-1)


def _checked_call(call: Callable[[], torch.Tensor], where: str, runner: DraftRunner,
                  shadow: DraftRunner, layer: AttentionLayer, loc: torch.Tensor,
                  k: torch.Tensor, v: Optional[torch.Tensor],
                  reference: Callable[[DraftRunner], torch.Tensor], dtype: torch.dtype,
                  poison: bool, **compare) -> float:
    """One forward call checked like every numerics case: the kit writes the call's new KV
    into its own copy of the pools, the backend's pools must equal it (checked first: it names
    a missing write), then the output must match ``reference`` computed from that copy.
    Returns the max abs error."""
    out = _forward(call, where)
    shadow.write_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)
    _check_pools(runner, shadow, loc, where)
    ref = reference(_dense(shadow, layer))
    msg = output_mismatch(out, ref, dtype, free_rows=_free_rows(ref) if poison else None,
                          **compare)
    if msg:
        raise CaseFailed(f"{where}: {msg}")
    return float((out.float() - ref.float()).abs().max())


def run_decode_round(s: Session, case: Case, backend, rnd: DecodeRound, shape: ModelShape,
                     gen: torch.Generator, *, logit_cap: float = 0.0,
                     fused_qkv: bool = False, both_layers: bool = False,
                     poison: bool = False, scales: Optional[tuple[Scale, Scale]] = None) -> str:
    """``init_forward_metadata`` then every step and layer, each checked against the
    reference and the expected pools. ``poison``: lane 0's new key at step 0 is NaN; the
    lanes that do not attend it must come out exactly as the reference. ``scales``: the
    layers' ``(k_scale, v_scale)`` (default: the case's)."""
    runner, dtype = rnd.runner, case.dtype
    shadow = shadow_runner(runner)
    backend.init_forward_metadata(rnd.batch)
    worst = 0.0
    for step in range(rnd.num_steps):
        _fill_parents(rnd, step)
        loc = rnd.batch.out_cache_loc[:, :, step].reshape(-1)
        layers = _layers(shape, logit_cap, both_layers,
                         scales or case.params.get("scales", (1.0, 1.0)))
        for layer in layers:
            where = f"step {step}, layer {layer.layer_id}"
            q, k, v = random_qkv(runner, rnd.lanes, gen, fused=fused_qkv)
            if poison and step == 0:
                _poison_row(k, v, 0)
            err = _checked_call(
                lambda: backend.forward(step, layer, q, k, v), where, runner, shadow, layer,
                loc, k, v,
                lambda pools: reference_decode(pools, layer, q, rnd.batch, step, rnd.tree_mode),
                dtype, poison, topk=rnd.topk)
            worst = max(worst, err)
    return f"{rnd.batch.batch_size} requests x {rnd.num_steps} steps x {len(layers)} " \
           f"layer(s); max abs error {worst:.2g}"


def decode_numerics(s: Session, case: Case) -> str:
    p = case.params
    shape = s.shape(case)
    lens = p.get("lens") or decode_lengths(case.page_size, p.get("ragged", True))
    style = p.get("style", EngineStyle())
    maker = _decode_maker(s, case, shape, [lens], style, max_reqs=max(5, len(lens) + 1))
    rnd = maker.decode(lens, case.topk, NUM_STEPS, case.tree_mode)
    backend = _construct_over(s, case, maker.runner, style)
    return shape.label() + ", " + run_decode_round(
        s, case, backend, rnd, shape, s.generator(case, "qkv"),
        logit_cap=p.get("logit_cap", 0.0), fused_qkv=style.fused_qkv,
        both_layers=p.get("both_layers", False), poison=p.get("poison", False))


def decode_determinism(s: Session, case: Case) -> str:
    shape = s.shape(case)
    lens = decode_lengths(case.page_size, True)
    outs = []
    for _ in range(2):
        maker = _decode_maker(s, case, shape, [lens])  # same seeds: the same round
        rnd = maker.decode(lens, case.topk, NUM_STEPS, case.tree_mode)
        backend = s.construct(case, maker.runner)
        gen = s.generator(case, "qkv")
        backend.init_forward_metadata(rnd.batch)
        run = []
        for step in range(NUM_STEPS):
            _fill_parents(rnd, step)
            for layer in _layers(shape):
                q, k, v = random_qkv(maker.runner, rnd.lanes, gen)
                run.append(_forward(lambda: backend.forward(step, layer, q, k, v),
                                    f"step {step}"))
        outs.append(run)
    for i, (a, b) in enumerate(zip(*outs)):
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            raise CaseFailed(f"call {i} (step {i // 2}) gave different outputs on identical "
                             f"inputs (max difference {diff:.3g})")
    return f"{len(outs[0])} calls bitwise identical"


def decode_scale_change(s: Session, case: Case) -> str:
    """Two eager rounds on one backend object whose layers carry one-element device tensors
    as scales (SGLang's ``layer.k_scale``), their values changed in place between the rounds
    (the pools are filled with the new ones): a backend that reads only Python-float scales,
    or keeps the values of its first call, differs from the reference. The graph case's
    ``scale_change`` checks the same across replays for backends that capture graphs."""
    shape = s.shape(case)
    lens = decode_lengths(case.page_size, True)
    maker = _decode_maker(s, case, shape, [lens])
    scales = _graph_scales(s, case, maker)
    backend = s.construct(case, maker.runner)
    gen = s.generator(case, "qkv")
    _scale_rounds(scales, [
        lambda lens=round_lens: run_decode_round(
            s, case, backend, maker.decode(lens, case.topk, NUM_STEPS, case.tree_mode), shape,
            gen, scales=scales)
        for round_lens in (lens, list(reversed(lens)))])
    return f"{shape.label()}, 2 rounds, scales changed in place between them"


def _scale_rounds(scales: tuple[Scale, Scale], rounds: list[Callable[[], object]]) -> None:
    """Run ``rounds`` in order, round ``n`` after ``_round_scales(scales, n)`` (a round makes
    its pools with the new values); a failure names its round and scales."""
    for n, run in enumerate(rounds):
        _round_scales(scales, n)
        try:
            run()
        except CaseFailed as exc:
            k, v = FP8_SCALE_ROUNDS[n % len(FP8_SCALE_ROUNDS)]
            raise CaseFailed(f"round {n} (one-element tensor scales k_scale={k}, "
                             f"v_scale={v}): {exc}") from exc


def _graph_scales(s: Session, case: Case, maker: RoundMaker) -> tuple[Scale, Scale]:
    """The layers' ``(k_scale, v_scale)`` of a graph (or eager ``scale_change``) case: with
    ``tensor_scales``, one-element device tensors (the maker fills the pools with them too)
    that ``_round_scales`` changes between rounds; else the case's floats."""
    if not case.params.get("tensor_scales"):
        return case.params.get("scales", (1.0, 1.0))
    pair = tuple(torch.tensor([x], dtype=torch.float32, device=s.device)
                 for x in FP8_SCALE_ROUNDS[0])
    maker.k_scale, maker.v_scale = pair
    return pair


def _round_scales(scales: tuple[Scale, Scale], n: int) -> None:
    """Round ``n``'s values into a graph case's scale tensors (in place, as an engine that
    updates ``layer.k_scale`` does)."""
    for t, value in zip(scales, FP8_SCALE_ROUNDS[n % len(FP8_SCALE_ROUNDS)]):
        if isinstance(t, torch.Tensor):
            t.fill_(value)


class _GraphRunner:
    """Runs a list of calls as one captured CUDA graph (on CUDA), or eagerly (elsewhere:
    the graph protocol's buffer handling is still exercised, only the capture is not).
    Either way the calls run once first, after the capture's metadata, as an engine's
    warm-up runs them before it captures (a backend may plan for the layers' parameters
    there, outside the graph)."""

    def __init__(self, device: torch.device, calls: Callable[[], list[torch.Tensor]]):
        self.calls = calls
        self.graph = None
        self.outs: list[torch.Tensor] = []
        if device.type != "cuda":
            calls()  # the warm-up
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                calls()  # warm-up: compiles kernels, allocates workspaces
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outs = calls()

    def replay(self) -> list[torch.Tensor]:
        if self.graph is None:
            return [o.clone() for o in self.calls()]
        self.graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in self.outs]


@dataclass
class _Static:
    """Fixed index buffers, as an engine keeps them for a captured graph."""

    tensors: dict[str, torch.Tensor]

    def load(self, values: dict[str, torch.Tensor], pad: dict[str, Any]) -> None:
        for name, buf in self.tensors.items():
            src = values[name]
            n = src.shape[0]
            buf[:n] = src.to(buf.dtype)
            buf[n:] = pad[name]


def decode_graph(s: Session, case: Case) -> str:
    cls = s.cls(case)
    if not cls.supports_cuda_graph:
        raise CaseSkipped("declares supports_cuda_graph = False")
    shape = s.shape(case)
    max_bs, topk = 3, case.topk
    # The serving loop captures steps 0 .. S-2 of a backend built for S steps; the
    # ``last_step`` variant captures step S-1 too, which a backend may refuse at capture.
    last_step = case.params.get("last_step", False)
    slots = NUM_STEPS if last_step else NUM_STEPS + 1  # the backend's S: draft slots per lane
    rounds_lens = [decode_lengths(case.page_size, True),              # capture
                   decode_lengths(case.page_size, False),             # replay: 2 of 3 padded
                   list(reversed(decode_lengths(case.page_size, True)))]
    maker = _decode_maker(s, case, shape, rounds_lens, num_steps=slots)
    runner, dev = maker.runner, s.device
    # The engine's fixed buffers, with the host copy of the lengths an engine keeps (the
    # eager cases give none: both ways of learning the lengths are exercised).
    static = _Static({"req_pool_indices": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                      "seq_lens": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                      "seq_lens_cpu": torch.zeros(max_bs, dtype=torch.int64),
                      "out_cache_loc": torch.zeros(max_bs, topk, slots, dtype=torch.int64,
                                                   device=dev)})
    # ``parents`` is not loaded with the round: as in the draft loop, row ``i`` is written
    # inside the graph just before step ``i`` (from ``parents_plan``), so a backend that
    # reads the parents when the replay's metadata is made sees zeros and fails.
    parents = parents_plan = None
    if case.tree_mode == "path":
        parents, parents_plan = (torch.zeros(slots, max_bs, topk, dtype=torch.int64,
                                             device=dev) for _ in range(2))
    t = static.tensors
    batch = DraftBatch(t["req_pool_indices"], t["seq_lens"], t["out_cache_loc"], parents,
                       t["seq_lens_cpu"])
    backend = s.construct(case, runner, num_steps=slots)
    backend.init_cuda_graph_state(max_bs, max_bs * topk)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    # Padded requests use request row 0 (page 0 only), their draft slots laid out like any
    # request's (metadata.draft_slot_positions), so they all land in page 0.
    pos = metadata.draft_slot_positions(torch.tensor([fill]), topk, slots,
                                        case.page_size)[0].to(dev)
    pad = {"req_pool_indices": 0, "seq_lens": fill, "seq_lens_cpu": fill}
    scales = _graph_scales(s, case, maker)
    layers = _layers(shape, scales=scales)
    gen = s.generator(case, "qkv")
    inputs = [[random_qkv(runner, max_bs * topk, gen) for _ in layers] for _ in range(NUM_STEPS)]

    def place(lens: list[int]) -> DecodeRound:
        rnd = maker.decode(lens, topk, slots, case.tree_mode)
        values = {"req_pool_indices": rnd.batch.req_pool_indices,
                  "seq_lens": rnd.batch.seq_lens, "seq_lens_cpu": torch.tensor(lens),
                  "out_cache_loc": rnd.batch.out_cache_loc}
        if parents is not None and parents_plan is not None:
            parents.zero_()
            parents_plan.zero_()
            parents_plan[:, :len(lens)] = rnd.parents_plan.to(dev)
        pad["out_cache_loc"] = runner.req_to_token[0, pos].long()
        static.load(values, pad)
        return rnd

    def calls() -> list[torch.Tensor]:
        outs = []
        for step in range(NUM_STEPS):
            if parents is not None and parents_plan is not None and step > 0:
                parents[step].copy_(parents_plan[step])  # the draft loop's in-graph write
            outs += [backend.forward(step, layer, *inputs[step][i])
                     for i, layer in enumerate(layers)]
        return outs

    place(rounds_lens[0])
    backend.init_forward_metadata_capture_cuda_graph(batch)
    try:
        graph = _GraphRunner(dev, calls)
    except SpecAttnError as exc:
        if not (last_step and dev.type == "cuda"):
            raise
        return f"refuses to capture step S-1 (outside the serving loop): {exc}"
    details = []
    for n, lens in enumerate(rounds_lens):
        _round_scales(scales, n)  # the pools of the round and the replay use the new values
        place(lens)  # the round written into the captured batch in place
        bs_real = len(lens)
        backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
        shadow = shadow_runner(runner)
        for q_k_v in inputs:  # fresh inputs, written into the static tensors in place
            for qkv in q_k_v:
                for tensor in qkv:
                    if tensor is not None:
                        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
        outs = graph.replay()
        real = bs_real * topk
        # The round's own view of the batch (unpadded) for the reference.
        ref_batch = DraftBatch(t["req_pool_indices"][:bs_real], t["seq_lens"][:bs_real],
                               t["out_cache_loc"][:bs_real],
                               None if parents is None else parents[:, :bs_real])
        written = []
        for step in range(NUM_STEPS):
            loc = t["out_cache_loc"][:, :, step].reshape(-1)
            written.append(loc)
            for i, layer in enumerate(layers):
                shadow.write_kv(layer.layer_id, loc, inputs[step][i][1], inputs[step][i][2],
                                layer.k_scale, layer.v_scale)
        exempt = torch.arange(case.page_size)  # page 0: the padding lanes' slots
        for step in range(NUM_STEPS):
            for i, layer in enumerate(layers):
                q = inputs[step][i][0][:real]
                ref = reference_decode(_dense(shadow, layer), layer, q, ref_batch, step,
                                       case.tree_mode)
                msg = output_mismatch(outs[step * len(layers) + i][:real], ref, case.dtype,
                                      topk=topk)
                if msg:
                    what = "capture batch" if n == 0 else f"replay {n} ({bs_real} requests " \
                        f"padded to {max_bs})" if bs_real < max_bs else f"replay {n}"
                    raise CaseFailed(f"{what}, step {step}, layer {layer.layer_id}: {msg}")
        _check_pools(runner, shadow, torch.cat(written), f"after replay {n}", exempt)
        details.append(f"{bs_real}/{max_bs}")
    mode = "captured CUDA graph" if graph.graph is not None else "eager (no CUDA here)"
    changed = "; scales changed at every replay" if case.params.get("tensor_scales") else ""
    return f"{mode}; rounds of {', '.join(details)} requests match the reference{changed}"


# --- extend ------------------------------------------------------------------------------------------


def partial_page_lengths(page_size: int) -> tuple[list[int], list[int]]:
    """``(seq_lens, extend_lens)`` whose first request's last token, a new one, opens a
    page: the one-slot page past a ``partial_last_page`` pool's whole pages."""
    return [page_size + 1, 2 * page_size + 3], [2, 3]


def partial_page_prefixes(page_size: int) -> list[int]:
    """Decode prefixes at ``K`` 1 whose first request's last draft slot (step
    ``NUM_STEPS - 1``) opens a page: the one-slot page past a ``partial_last_page`` pool."""
    return [page_size + 1 - NUM_STEPS, 2 * page_size + 5]


def _construct_over(s: Session, case: Case, runner: DraftRunner, style: EngineStyle):
    """``s.construct``; a backend that pages the pool may refuse a ``partial_last_page``
    pool when built (a skip naming the refusal)."""
    try:
        return s.construct(case, runner)
    except InvalidInputError as exc:
        if style.partial_last_page and exc.argument == "runner pools":
            raise CaseSkipped(f"refuses pools of a partial last page: {exc}") from None
        raise


def extend_lengths(page_size: int, ragged: bool) -> tuple[list[int], list[int]]:
    """``(seq_lens, extend_lens)``: ragged includes a request with no prefix (L' = E)."""
    big = page_size > 16
    if ragged:
        ext = [3, 1, 4]
        prefix = [0, page_size + 3, 2 * page_size + 1] if big else [0, 17, 29]
    else:
        ext = [4, 4]
        prefix = [page_size + 4] * 2 if big else [20, 20]
    return [a + b for a, b in zip(prefix, ext)], ext


def run_extend(s: Session, case: Case, backend, rnd: ExtendRound, shape: ModelShape,
               gen: torch.Generator, *, logit_cap: float = 0.0, fused_qkv: bool = False,
               both_layers: bool = False, poison: bool = False,
               scales: Optional[tuple[Scale, Scale]] = None) -> str:
    """``poison``: the third new token of the first request with three or more has a NaN
    key; the tokens before it (and other requests) must come out exactly as the
    reference. ``scales``: the layers' ``(k_scale, v_scale)`` (default: the case's)."""
    runner = rnd.runner
    shadow = shadow_runner(runner)
    backend.init_forward_metadata(rnd.batch)
    loc = rnd.batch.out_cache_loc
    worst = 0.0
    layers = _layers(shape, logit_cap, both_layers,
                     scales or case.params.get("scales", (1.0, 1.0)))
    for layer in layers:
        where = f"layer {layer.layer_id}"
        q, k, v = random_qkv(runner, rnd.num_tokens, gen, fused=fused_qkv)
        if poison:
            ext = rnd.batch.extend_lens.tolist()
            b = next(i for i, e in enumerate(ext) if e >= 3)
            _poison_row(k, v, sum(ext[:b]) + 2)
        err = _checked_call(
            lambda: backend.forward(layer, q, k, v), where, runner, shadow, layer, loc, k, v,
            lambda pools: reference_extend(pools, layer, q, rnd.batch), case.dtype, poison,
            rows_are="token")
        worst = max(worst, err)
    return f"{rnd.batch.batch_size} requests, {rnd.num_tokens} tokens x {len(layers)} " \
           f"layer(s); max abs error {worst:.2g}"


def extend_numerics(s: Session, case: Case) -> str:
    p = case.params
    shape = s.shape(case)
    seq, ext = p.get("lens") or extend_lengths(case.page_size, p.get("ragged", True))
    style = p.get("style", EngineStyle())
    maker = s.maker(case, shape, max_tokens=max(seq), style=style,
                    max_reqs=max(5, len(seq) + 1))
    rnd = maker.extend(seq, ext)
    backend = _construct_over(s, case, maker.runner, style)
    return shape.label() + ", " + run_extend(s, case, backend, rnd, shape,
                                             s.generator(case, "qkv"),
                                             logit_cap=p.get("logit_cap", 0.0),
                                             fused_qkv=style.fused_qkv,
                                             both_layers=p.get("both_layers", False),
                                             poison=p.get("poison", False))


def extend_determinism(s: Session, case: Case) -> str:
    shape = s.shape(case)
    seq, ext = extend_lengths(case.page_size, True)
    outs = []
    for _ in range(2):
        maker = s.maker(case, shape, max_tokens=max(seq))
        rnd = maker.extend(seq, ext)
        backend = s.construct(case, maker.runner)
        backend.init_forward_metadata(rnd.batch)
        gen = s.generator(case, "qkv")
        run = []
        for layer in _layers(shape):
            q, k, v = random_qkv(maker.runner, rnd.num_tokens, gen)
            run.append(_forward(lambda: backend.forward(layer, q, k, v), "forward"))
        outs.append(run)
    for i, (a, b) in enumerate(zip(*outs)):
        if not torch.equal(a, b):
            raise CaseFailed(f"call {i} gave different outputs on identical inputs (max "
                             f"difference {(a.float() - b.float()).abs().max().item():.3g})")
    return f"{len(outs[0])} calls bitwise identical"


def extend_scale_change(s: Session, case: Case) -> str:
    """``decode_scale_change`` for draft extend: two eager batches on one backend object,
    tensor scales changed in place between them."""
    shape = s.shape(case)
    seq, ext = extend_lengths(case.page_size, True)
    maker = s.maker(case, shape, max_tokens=max(seq))
    scales = _graph_scales(s, case, maker)
    backend = s.construct(case, maker.runner)
    gen = s.generator(case, "qkv")
    _scale_rounds(scales, [
        lambda seq=round_seq, ext=round_ext: run_extend(s, case, backend,
                                                        maker.extend(seq, ext), shape, gen,
                                                        scales=scales)
        for round_seq, round_ext in ((seq, ext), (seq[::-1], ext[::-1]))])
    return f"{shape.label()}, 2 batches, scales changed in place between them"


def extend_graph(s: Session, case: Case) -> str:
    cls = s.cls(case)
    if not cls.supports_cuda_graph:
        raise CaseSkipped("declares supports_cuda_graph = False")
    shape = s.shape(case)
    big = case.page_size > 16
    base = case.page_size + 2 if big else 11
    # Rounds in a graph of 3 requests and 8 new tokens: the capture; replays the engine pads
    # to both ("padded": 2 real requests + 1 padding request of row 0, its 3 tokens in page
    # 0), with another split; one whose requests the engine pads with a padding request of
    # one token but not its tokens ("short": the backend pads the tokens); and one of 6
    # tokens the engine does not pad ("unpadded": the backend pads both). The backend's
    # captured work must find none of an earlier round's slots.
    plans = [([base, 5 + base, 2 * base], [3, 1, 4], "padded"),
             ([2 + base, 3], [2, 3], "padded"),
             ([1, base + 4, 3 + base], [1, 4, 3], "padded"),
             ([base + 3, 2], [2, 1], "short"),
             ([base + 1, 4, base + 2], [2, 3, 1], "unpadded")]
    total, max_bs = 8, 3
    maker = s.maker(case, shape, max_tokens=max(max(p[0]) for p in plans))
    runner, dev = maker.runner, s.device
    # With host copies of the lengths, as in decode_graph.
    static = _Static({"req_pool_indices": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                      "seq_lens": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                      "extend_lens": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                      "seq_lens_cpu": torch.zeros(max_bs, dtype=torch.int64),
                      "extend_lens_cpu": torch.zeros(max_bs, dtype=torch.int64),
                      "out_cache_loc": torch.zeros(total, dtype=torch.int64, device=dev)})
    t = static.tensors
    batch = DraftExtendBatch(t["req_pool_indices"], t["seq_lens"], t["extend_lens"],
                             t["out_cache_loc"], t["seq_lens_cpu"], t["extend_lens_cpu"])

    def unpadded_batch(bs: int, tokens: int) -> DraftExtendBatch:
        """The round's own size: views of the fixed buffers (the rest keeps the last
        round's values, as an engine's buffers do)."""
        return DraftExtendBatch(t["req_pool_indices"][:bs], t["seq_lens"][:bs],
                                t["extend_lens"][:bs], t["out_cache_loc"][:tokens],
                                t["seq_lens_cpu"][:bs], t["extend_lens_cpu"][:bs])
    backend = s.construct(case, runner)
    backend.init_cuda_graph_state(max_bs, total)
    scales = _graph_scales(s, case, maker)
    layers = _layers(shape, scales=scales)
    gen = s.generator(case, "qkv")
    inputs = [random_qkv(runner, total, gen) for _ in layers]

    def place(seq: list[int], ext: list[int], mode: str) -> int:
        """The round into the fixed buffers, padded as ``mode`` says; its real requests."""
        rnd = maker.extend(seq, ext)
        pad_tokens = 1 if mode == "short" else total - sum(ext)
        values = {"req_pool_indices": rnd.batch.req_pool_indices,
                  "seq_lens": rnd.batch.seq_lens, "extend_lens": rnd.batch.extend_lens,
                  "seq_lens_cpu": torch.tensor(seq), "extend_lens_cpu": torch.tensor(ext),
                  "out_cache_loc": rnd.batch.out_cache_loc}
        # The padding request is row 0, whose every page is page 0: at page size 1 all its
        # tokens share slot 0 (slots 1, 2, ... belong to real requests).
        pad_slots = runner.req_to_token[0, :pad_tokens].long()
        if mode == "unpadded":
            for name, src in values.items():
                t[name][:src.shape[0]] = src.to(t[name].dtype)
            return len(seq)
        static.load(values, {"req_pool_indices": 0, "seq_lens": pad_tokens,
                             "extend_lens": pad_tokens, "seq_lens_cpu": pad_tokens,
                             "extend_lens_cpu": pad_tokens, "out_cache_loc": pad_slots})
        return len(seq)

    def calls() -> list[torch.Tensor]:
        # A graph runs the capture's rows; without CUDA, forward runs the round's own.
        n = backend.num_tokens
        return [backend.forward(layer, *(x if x is None else x[:n] for x in inputs[i]))
                for i, layer in enumerate(layers)]

    def given(mode: str, bs_real: int, real: int) -> DraftExtendBatch:
        """The batch the engine passes: the fixed buffers, or views of the round's size."""
        if mode == "padded":
            return batch
        if mode == "short":  # every request, the real tokens and the padding request's one
            return unpadded_batch(max_bs, real + 1)
        return unpadded_batch(bs_real, real)

    place(*plans[0])
    backend.init_forward_metadata_capture_cuda_graph(batch)
    graph = _GraphRunner(dev, calls)
    for n, (seq, ext, mode) in enumerate(plans):
        _round_scales(scales, n)
        bs_real = place(seq, ext, mode)
        replayed = given(mode, bs_real, sum(ext))
        backend.init_forward_metadata_replay_cuda_graph(replayed, max_bs)
        for qkv in inputs:
            for tensor in qkv:
                if tensor is not None:
                    tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
        shadow = shadow_runner(runner)
        outs = graph.replay()
        real = sum(ext)
        ref_batch = DraftExtendBatch(t["req_pool_indices"][:bs_real], t["seq_lens"][:bs_real],
                                     t["extend_lens"][:bs_real], t["out_cache_loc"][:real])
        written = replayed.out_cache_loc
        for i, layer in enumerate(layers):
            k_new, v_new = (x if x is None else x[:written.shape[0]] for x in inputs[i][1:])
            shadow.write_kv(layer.layer_id, written, k_new, v_new, layer.k_scale,
                            layer.v_scale)
        for i, layer in enumerate(layers):
            ref = reference_extend(_dense(shadow, layer), layer, inputs[i][0][:real], ref_batch)
            msg = output_mismatch(outs[i][:real], ref, case.dtype)
            if msg:
                raise CaseFailed(f"round {n} ({bs_real} requests, {real} tokens, "
                                 f"{mode}, in a graph of {max_bs} and {total}), "
                                 f"layer {layer.layer_id}: {msg}")
        _check_pools(runner, shadow, written, f"after round {n}", torch.arange(case.page_size))
    kind = "captured CUDA graph" if graph.graph is not None else "eager (no CUDA here)"
    changed = "; scales changed at every replay" if case.params.get("tensor_scales") else ""
    return (f"{kind}; {len(plans)} rounds (padded by the engine, its requests only, or "
            f"not at all) match the reference{changed}")
