"""Bad inputs every backend must refuse with a ``specattn`` error that blames the argument.

Each refusal builds a valid round, breaks one thing, and expects a ``SpecAttnError`` whose
``argument`` is (or, without one, whose message starts with) the argument's name
(``names_argument``). Checks that need tensor values (lengths, slots) run on
the CPU always and on a device in debug mode (``SPECATTN_DEBUG_CHECKS=1``), which the kit turns
on around those cases: on a device they are never paid for in production.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

import torch

from ..data import AttentionLayer, DraftBatch, DraftExtendBatch
from ..errors import SpecAttnError
from .checks import (NUM_STEPS, Case, CaseFailed, CaseSkipped, Session, _decode_maker,
                     _layers, decode_lengths, extend_lengths)
from .rounds import random_qkv

__all__ = ["Refusal", "DECODE_REFUSALS", "EXTEND_REFUSALS", "run_refusal"]


@dataclass(frozen=True)
class Refusal:
    """``act(fixture)`` must raise a ``SpecAttnError`` that blames ``argument``
    (``names_argument``).
    ``values``: the check reads tensor values (debug mode on a device). ``path``: only for
    backends that serve ``tree_mode='path'``. ``graph``: only for backends that declare
    ``supports_cuda_graph``. ``fp8``: on an FP8 pool (``kv_cache_dtype`` the first FP8 name
    the backend declares; skipped without one)."""

    name: str
    argument: str
    act: Callable[["_Fixture"], object]
    values: bool = False
    path: bool = False
    graph: bool = False
    fp8: bool = False


@dataclass
class _Fixture:
    session: Session
    case: Case
    runner: object
    batch: object
    backend: object
    layer: AttentionLayer
    rows: int
    gen: torch.Generator

    def qkv(self, rows=None):
        return random_qkv(self.runner, self.rows if rows is None else rows, self.gen)

    def construct(self, **kw):
        return self.session.construct(self.case, self.runner, **kw)

    def forward(self, *args):
        if self.case.kind == "decode":
            step = args[0] if args else 0
            q, k, v = args[1:] if len(args) > 1 else self.qkv()
            return self.backend.forward(step, self.layer, q, k, v)
        q, k, v = args if args else self.qkv()
        return self.backend.forward(self.layer, q, k, v)

    def init(self, batch=None):
        return self.backend.init_forward_metadata(self.batch if batch is None else batch)


def _with(batch, **changes):
    return replace(batch, **changes)


def _bump(t: torch.Tensor, value) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = value
    return t


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16 if t.dtype != torch.float16 else torch.float32)


def _other_extend_batch(f: _Fixture) -> DraftExtendBatch:
    b = f.batch
    return DraftExtendBatch(b.req_pool_indices, b.seq_lens, torch.ones_like(b.seq_lens),
                            b.out_cache_loc[:, 0, 0])


def _other_decode_batch(f: _Fixture) -> DraftBatch:
    b = f.batch
    loc = b.out_cache_loc[: b.batch_size].reshape(-1, 1, 1).expand(-1, 1, NUM_STEPS)
    return DraftBatch(b.req_pool_indices, b.seq_lens, loc[: b.batch_size].contiguous())


def _duplicate_loc(loc: torch.Tensor) -> torch.Tensor:
    """Two tokens (two lanes of one step, or two extend tokens) given one slot."""
    loc = loc.clone()
    flat = loc.view(-1)
    flat[1] = flat[0]
    return loc


def _prefix_row(f: _Fixture) -> int:
    """The ``req_to_token`` row of a request of the round with a prefix (the longest)."""
    b = int(torch.argmax(f.batch.seq_lens.cpu()))
    return int(f.batch.req_pool_indices.view(-1)[b])


def _req_to_token_entry(f: _Fixture, value: int) -> object:
    """A prefix entry of ``req_to_token`` outside ``[0, num_slots)``."""
    f.runner.req_to_token[_prefix_row(f), 0] = value
    return _then_forward(f, f.batch)


def _engine_runner(f: _Fixture) -> object:
    """An engine's model runner in place of a ``DraftRunner``: it has ``use_mla_backend``,
    all that selection reads, and none of the pools a backend reads."""
    return f.session.construct(f.case, SimpleNamespace(use_mla_backend=f.runner.use_mla_backend))


def _then_forward(f: _Fixture, batch) -> object:
    f.init(batch)
    return f.forward()


def _draft_slot_in_prefix_batch(f: _Fixture) -> DraftBatch:
    """The round with a lane's draft slot on the longest prefix's last token (outside page
    0): its step would overwrite committed KV."""
    last = int(f.batch.seq_lens.max()) - 1  # of the request _prefix_row picks
    return _with(f.batch, out_cache_loc=_bump(
        f.batch.out_cache_loc, int(f.runner.req_to_token[_prefix_row(f), last])))


def _draft_slot_in_prefix(f: _Fixture) -> object:
    """A lane's draft slot that holds a prefix token (its step would overwrite it)."""
    return _then_forward(f, _draft_slot_in_prefix_batch(f))


def _new_token_slots_swapped(f: _Fixture) -> object:
    """The first and last new tokens' slots swapped: each still in the pool and distinct,
    neither where ``req_to_token`` puts its token."""
    loc = f.batch.out_cache_loc.clone()
    loc[0], loc[-1] = f.batch.out_cache_loc[-1], f.batch.out_cache_loc[0]
    return _then_forward(f, _with(f.batch, out_cache_loc=loc))


def _scale_on_another_device(f: _Fixture) -> object:
    """A one-element ``k_scale`` tensor that is not on the pools' device."""
    f.init()
    return f.backend.forward(*([0] if f.case.kind == "decode" else []), AttentionLayer(
        f.layer.layer_id, f.layer.scaling, k_scale=torch.ones(1, device="meta")), *f.qkv())


def _bad_parents(f: _Fixture) -> object:
    f.init()
    f.batch.parents[1] = f.case.topk  # lane index out of [0, topk)
    f.forward()
    return f.forward(1)


def _replay_below_batch(f: _Fixture) -> object:
    """A CUDA-graph replay whose captured batch size ``bs`` is below the round's requests
    (its fixed buffers would be read past the captured ones)."""
    n = f.batch.batch_size
    f.backend.init_cuda_graph_state(n, f.rows * NUM_STEPS)
    return f.backend.init_forward_metadata_replay_cuda_graph(f.batch, n - 1)


def _replay_of(f: _Fixture, batch) -> object:
    """``batch`` as the replay of a graph captured with the round's valid batch."""
    n = f.batch.batch_size
    f.backend.init_cuda_graph_state(n, f.rows * NUM_STEPS)
    f.backend.init_forward_metadata_capture_cuda_graph(f.batch)
    return f.backend.init_forward_metadata_replay_cuda_graph(batch, n)


def _top_slot_twice(loc: torch.Tensor) -> torch.Tensor:
    """``loc`` with its highest slot given to a second token too: outside page 0, where a
    replay's padding may share slots."""
    loc = loc.clone()
    flat = loc.view(-1)
    top = int(torch.argmax(flat))
    flat[(top + 1) % flat.numel()] = flat[top]
    return loc


# Slots and pool rows, the same for both kinds.
_POOL_REFUSALS = (
    Refusal("out_cache_loc_outside_pool", "out_cache_loc", lambda f: _then_forward(
        f, _with(f.batch, out_cache_loc=_bump(f.batch.out_cache_loc, f.runner.num_slots))),
        values=True),
    Refusal("duplicate_out_cache_loc", "out_cache_loc", lambda f: _then_forward(
        f, _with(f.batch, out_cache_loc=_duplicate_loc(f.batch.out_cache_loc))), values=True),
    Refusal("req_to_token_outside_pool", "req_to_token", lambda f: _req_to_token_entry(
        f, f.runner.num_slots), values=True),
    Refusal("req_to_token_negative", "req_to_token", lambda f: _req_to_token_entry(f, -1),
            values=True),
    Refusal("replay_bs_below_batch", "bs", _replay_below_batch, graph=True),
    Refusal("replay_duplicate_out_cache_loc", "out_cache_loc", lambda f: _replay_of(
        f, _with(f.batch, out_cache_loc=_top_slot_twice(f.batch.out_cache_loc))),
        values=True, graph=True),
    Refusal("k_scale_on_another_device", "k_scale", _scale_on_another_device, fp8=True),
)

DECODE_REFUSALS = (
    Refusal("forward_before_metadata", "init_forward_metadata", lambda f: f.forward()),
    Refusal("step_out_of_range", "step", lambda f: (f.init(), f.forward(NUM_STEPS))),
    Refusal("negative_step", "step", lambda f: (f.init(), f.forward(-1))),
    Refusal("q_wrong_rows", "q", lambda f: (f.init(), f.forward(0, *f.qkv(f.rows + 1)[:1],
                                                               *f.qkv()[1:]))),
    Refusal("q_wrong_dtype", "q", lambda f: (f.init(), f.forward(
        0, _wrong_dtype(f.qkv()[0]), *f.qkv()[1:]))),
    Refusal("k_wrong_rows", "k", lambda f: (f.init(), f.forward(
        0, f.qkv()[0], f.qkv(f.rows + 1)[1], f.qkv(f.rows + 1)[2]))),
    Refusal("layer_out_of_range", "layer", lambda f: (f.init(), f.backend.forward(
        0, AttentionLayer(f.runner.num_layers, 0.1), *f.qkv()))),
    Refusal("seq_lens_beyond_context", "seq_lens", lambda f: _then_forward(
        f, _with(f.batch, seq_lens=_bump(f.batch.seq_lens, f.runner.max_context_len + 1))),
        values=True),
    Refusal("req_pool_indices_outside", "req_pool_indices", lambda f: _then_forward(
        f, _with(f.batch, req_pool_indices=_bump(f.batch.req_pool_indices,
                                                 f.runner.max_reqs))), values=True),
    *_POOL_REFUSALS,
    Refusal("extend_batch_given", "batch", lambda f: _then_forward(f, _other_extend_batch(f))),
    Refusal("topk_zero", "topk", lambda f: f.construct(topk=0)),
    Refusal("num_steps_zero", "num_steps", lambda f: f.construct(num_steps=0)),
    Refusal("runner_not_a_draft_runner", "runner", _engine_runner),
    Refusal("path_without_parents", "parents", lambda f: _then_forward(
        f, _with(f.batch, parents=None)), path=True),
    Refusal("parents_out_of_range", "parents", _bad_parents, values=True, path=True),
    Refusal("out_cache_loc_in_prefix", "out_cache_loc", _draft_slot_in_prefix, values=True),
    Refusal("replay_out_cache_loc_in_prefix", "out_cache_loc", lambda f: _replay_of(
        f, _draft_slot_in_prefix_batch(f)), values=True, graph=True),
)

EXTEND_REFUSALS = (
    Refusal("forward_before_metadata", "init_forward_metadata", lambda f: f.forward()),
    Refusal("q_wrong_rows", "q", lambda f: (f.init(), f.forward(
        *f.qkv(f.rows + 1)[:1], *f.qkv()[1:]))),
    Refusal("layer_out_of_range", "layer", lambda f: (f.init(), f.backend.forward(
        AttentionLayer(f.runner.num_layers, 0.1), *f.qkv()))),
    Refusal("decode_batch_given", "batch", lambda f: _then_forward(f, _other_decode_batch(f))),
    Refusal("runner_not_a_draft_runner", "runner", _engine_runner),
    Refusal("seq_lens_below_extend_lens", "seq_lens", lambda f: _then_forward(
        f, _with(f.batch, seq_lens=_bump(f.batch.seq_lens,
                                         int(f.batch.extend_lens.view(-1)[0]) - 1))),
        values=True),
    *_POOL_REFUSALS,
    Refusal("out_cache_loc_wrong_length", "out_cache_loc", lambda f: _then_forward(
        f, _with(f.batch, out_cache_loc=f.batch.out_cache_loc[1:])), values=True),
    Refusal("out_cache_loc_not_req_to_token", "out_cache_loc", _new_token_slots_swapped,
            values=True),
)


def _fixture(s: Session, case: Case) -> _Fixture:
    """A valid round for ``case``; refusals are model-independent, so when the kit has no
    shape for ``case.model`` (say dsv4's MHA form) the other model of the backend serves."""
    try:
        return _fixture_for(s, case)
    except CaseSkipped:
        for model in ("mha", "mla"):
            other = replace(case, model=model)
            if model != case.model and isinstance(s.target.class_for(case.kind, model), type):
                with contextlib.suppress(CaseSkipped):
                    return _fixture_for(s, other)
        raise


def _fixture_for(s: Session, case: Case) -> _Fixture:
    shape = s.shape(case)
    gen = s.generator(case, "qkv")
    if case.kind == "decode":
        lens = decode_lengths(case.page_size, True)
        maker = _decode_maker(s, case, shape, [lens])
        rnd = maker.decode(lens, case.topk, NUM_STEPS, case.tree_mode)
        batch, rows = rnd.batch, rnd.lanes
        if rnd.parents_plan is not None:
            batch.parents.copy_(rnd.parents_plan.to(batch.parents.device))
    else:
        seq, ext = extend_lengths(case.page_size, True)
        maker = s.maker(case, shape, max_tokens=max(seq))
        rnd = maker.extend(seq, ext)
        batch, rows = rnd.batch, rnd.num_tokens
    backend = s.construct(case, maker.runner)
    return _Fixture(s, case, maker.runner, batch, backend, _layers(shape)[0], rows, gen)


def names_argument(exc: SpecAttnError, argument: str) -> bool:
    """Whether ``exc`` blames ``argument``: its ``argument`` (``InvalidInputError``'s
    ``batch.out_cache_loc``, ``layer.k_scale``, ``batch.parents[1:2]``) has it as a dotted or
    indexed part, or, without one, its message starts with it. A name found anywhere in
    the message would not do: ``q`` or ``k`` are in almost any message."""
    blamed = getattr(exc, "argument", None)
    if isinstance(blamed, str):
        return argument in re.split(r"[.\[]", blamed)
    return re.match(rf"{re.escape(argument)}\b", str(exc)) is not None


def run_refusal(s: Session, case: Case) -> str:
    refusal: Refusal = case.params["refusal"]
    fixture = _fixture(s, case)
    try:
        if refusal.values:
            with s.value_checks():
                refusal.act(fixture)
        else:
            refusal.act(fixture)
    except SpecAttnError as exc:
        if not names_argument(exc, refusal.argument):
            raise CaseFailed(f"refused with {type(exc).__name__}, but it does not name "
                             f"{refusal.argument!r} as the argument: {exc}") from exc
        return f"{type(exc).__name__}: {exc}"[:160]
    except Exception as exc:  # noqa: BLE001 - the point is to report what was raised
        raise CaseFailed(f"raised {type(exc).__name__} instead of a specattn error naming "
                         f"{refusal.argument!r}: {exc}") from exc
    raise CaseFailed(f"accepted the bad input silently (expected a specattn error naming "
                     f"{refusal.argument!r})")
