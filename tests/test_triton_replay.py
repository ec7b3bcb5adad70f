"""The ``triton`` backend's CUDA-graph replay metadata call on the CPU (interpreter).

- Its host work is fixed: the same Python lines and calls whatever the batch size and step
  count (no loop over requests or steps), no host synchronisation, no torch op, one kernel
  launch; the full checks run at the first call of a signature only (capture included).
- A replay of a kept signature fills the graph's buffers exactly as a first, checked call
  with the same batch does.
- ``KernelLaunch`` launches a kept compiled kernel with the arguments ``JITFunction.run``
  gives it, and falls back to the ordinary launch where that does not apply.
(``tests/gpu/test_host_work_gpu.py``: the same on the H200, and its host time.)
"""

from __future__ import annotations

import pytest
import torch

from helpers import (DEV, CountedKernel, checked_replay, decode_sizes, first_requests,
                     place_decode_round, place_extend_round, quiet_replay,
                     require_triton_interpret, strided_seq_lens, with_bad_slot)
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer, DraftBatch, DraftRunner
from specattn.errors import InvalidInputError

require_triton_interpret()

from specattn.backends.triton import (TritonDecode, TritonExtend, launchers,  # noqa: E402
                                      plans, worklist)
from specattn.kernels import kernel_launch  # noqa: E402

# (name, model, topk): MHA decode, MHA at K 1, MLA on the gluon-wl plan (its work list in
# the metadata launch), draft extend.
KINDS = [("mha", "mha", 2), ("mha-k1", "mha", 1), ("mla-gluon-wl", "mla", 2),
         ("extend", "mha", 1)]


def _runner(model: str, lens: list[int], topk: int, steps: int,
            shares: int = 1) -> DraftRunner:
    """Rows and slots for ``shares`` rounds of ``lens`` side by side (``helpers``' share)."""
    slots, ctx = decode_sizes(lens, topk, steps, 1)
    slots, reqs = slots * shares, (len(lens) + 2) * shares
    if model == "mla":  # the sm90 kernels' latent: the gluon-wl plan's model
        return DraftRunner.mla(4, 512, 64, num_layers=1, num_slots=slots, max_reqs=reqs,
                               max_context_len=ctx, dtype=torch.bfloat16, device=DEV)
    return DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=slots, max_reqs=reqs,
                           max_context_len=ctx, dtype=torch.bfloat16, device=DEV)


def _graph_backend(kind: str, model: str, topk: int, bs: int, steps: int, seed: int = 0):
    """A backend after ``init_cuda_graph_state`` and a capture at ``bs`` requests; the
    capture's batch and a batch of its signature with new values, on rows and slots of
    their own (either may be replayed after the other)."""
    torch.manual_seed(seed)
    lens = [5 + 7 * i for i in range(bs)]
    r = _runner(model, [n + 3 for n in lens], topk, steps, shares=2)
    if kind == "extend":
        ext = [1 + (i % steps) for i in range(bs)]
        backend = TritonExtend(r, topk=1, num_steps=steps, max_extend_len=steps)
        backend.init_cuda_graph_state(bs, sum(ext))
        first = place_extend_round(r, lens, ext, share=(0, 2))
        backend.init_forward_metadata_capture_cuda_graph(first)
        return backend, first, place_extend_round(r, [n + 3 for n in lens], ext[::-1],
                                                  share=(1, 2))
    backend = TritonDecode(r, topk, steps)
    backend.init_cuda_graph_state(bs, bs * topk)
    first = place_decode_round(r, lens, topk, steps, 1, share=(0, 2))
    backend.init_forward_metadata_capture_cuda_graph(first)
    return backend, first, place_decode_round(r, [n + 3 for n in lens], topk, steps, 1,
                                              share=(1, 2))


@pytest.mark.parametrize("kind,model,topk", KINDS)
def test_replay_metadata_call_is_fixed_host_work(monkeypatch, kind, model, topk):
    """At (B 1, S 2) and (B 4, S 5): the same calls and line count, one launch, no torch op,
    no host read, no check of the batch; checks again at a signature not seen."""
    if model == "mla":
        monkeypatch.setattr(plans, "gluon_reason", lambda runner, interpret: None)
    counted = {name: CountedKernel(getattr(launchers, name))
               for name in ("_decode_metadata_kernel", "_extend_metadata_kernel")}
    for name, stand_in in counted.items():
        monkeypatch.setattr(launchers, name, stand_in)
    worklist_alone = CountedKernel(worklist._worklist_kernel)
    monkeypatch.setattr(worklist, "_worklist_kernel", worklist_alone)
    seen = []
    for bs, steps in ((1, 2), (4, 5)):
        backend, _, batch = _graph_backend(kind, model, topk, bs, steps)
        if model == "mla":
            assert backend.plan.name == "gluon-wl"
        for stand_in in counted.values():
            stand_in.launches, stand_in.idle = 0, True
        calls, lines, ops, checks = quiet_replay(monkeypatch, backend, batch, bs)
        assert ops == [] and checks == []
        assert sum(s.launches for s in counted.values()) == 1 and worklist_alone.launches == 0
        seen.append((calls, lines))
        # Another signature (a batch padded to a larger capture; a strided view): checked.
        for stand_in in counted.values():
            stand_in.idle = False
        assert checked_replay(monkeypatch, backend, strided_seq_lens(batch), bs) == 1
    assert seen[0] == seen[1], "host work that grows with the batch size or step count"


def _filled(backend) -> list[torch.Tensor]:
    """What the metadata call wrote: the round's buffers and its fixed views."""
    bufs, batch = backend._active, backend.batch
    out = [bufs.meta.clone(), bufs.hist.clone(), batch.out_cache_loc.clone()]
    if isinstance(batch, DraftBatch):
        out += [batch.req_pool_indices.clone(), batch.seq_lens.clone()]
    if bufs.work is not None:
        out.append(bufs.work.clone())
    return out


@pytest.mark.parametrize("kind,model,topk,padded",
                         [k + (False,) for k in KINDS] +
                         [k + (True,) for k in KINDS if k[0] != "extend"])
def test_kept_replay_fills_as_a_checked_call(monkeypatch, kind, model, topk, padded):
    """A replay of a kept signature (after the capture, or after a first padded replay) and
    a first, checked replay of the same batch on a fresh backend write the same buffers (on
    a GPU the first launches the kept compiled kernel); the ``gluon-wl`` work list is
    ``worklist.fill``'s over the padded lengths. A kept signature's values are still checked
    where a graph call checks values (CPU tensors)."""
    if model == "mla":
        monkeypatch.setattr(plans, "gluon_reason", lambda runner, interpret: None)
    bs, steps = 3, 3
    kept, first, batch = _graph_backend(kind, model, topk, bs, steps, seed=1)
    if padded:
        kept.init_forward_metadata_replay_cuda_graph(first_requests(first, 2), bs)
        batch = first_requests(batch, 2)
    kept.init_forward_metadata_replay_cuda_graph(batch, bs)
    fresh, _, _ = _graph_backend(kind, model, topk, bs, steps, seed=1)
    fresh._replays.clear()
    fresh.init_forward_metadata_replay_cuda_graph(batch, bs)
    for a, b in zip(_filled(kept), _filled(fresh), strict=True):
        assert torch.equal(a, b)
    assert kept._round_plan == fresh._round_plan
    plan, work = kept._round_plan, kept._active.work
    assert (work is not None) == (plan["plan"].name == "gluon-wl") == (model == "mla")
    if work is not None:
        want = torch.full_like(work, -1)
        worklist.fill(kept.batch.seq_lens, want, plan["num_splits"], plan["wl_tail"],
                      plan["plan"].block_n)
        n = worklist.work_numel(plan["num_splits"], bs)
        assert torch.equal(work[:n], want[:n])
    if batch.out_cache_loc.device.type == "cpu":  # a graph call checks values there only
        with pytest.raises(InvalidInputError, match="out_cache_loc"):
            kept.init_forward_metadata_replay_cuda_graph(
                with_bad_slot(batch, kept.runner.num_slots), bs)


def test_padded_replays_keep_one_launch_per_signature():
    """Replays of 1, 2 and 3 requests into a graph captured at 3: each signature checked
    once, each replay padded (request row 0, ``seq_lens`` 1, slot 0)."""
    backend, _, batch = _graph_backend("mha", "mha", 2, 3, 3)
    for _ in range(2):
        for raw in (1, 2, 3):
            backend.init_forward_metadata_replay_cuda_graph(first_requests(batch, raw), 3)
            fixed = backend.batch
            assert torch.equal(fixed.seq_lens[:raw], batch.seq_lens[:raw])
            assert fixed.seq_lens[raw:].eq(1).all() and fixed.req_pool_indices[raw:].eq(0).all()
            assert not fixed.out_cache_loc[raw:].any()
    assert len(backend._replays) == 3  # the capture's signature is raw 3's
    with pytest.raises(InvalidInputError, match=r"^bs: "):
        backend.init_forward_metadata_replay_cuda_graph(batch, 4)


def test_a_kept_padded_replay_refuses_a_request_token_in_slot_0():
    """A replay of a kept signature (new values in the same tensors) runs the replay's own
    rules too: padded, no token of the batch in slot 0, which the padding lanes write."""
    backend, _, batch = _graph_backend("mha", "mha", 2, 3, 3)
    two = first_requests(batch, 2)
    backend.init_forward_metadata_replay_cuda_graph(two, 3)  # checked, then kept
    two.out_cache_loc[0, 1, 2] = 0
    with pytest.raises(InvalidInputError, match=r"^batch\.out_cache_loc: expected no slot 0 "
                       r"in a replay padded .*got slot 0 at out_cache_loc\[0, 1, 2\]$"):
        backend.init_forward_metadata_replay_cuda_graph(first_requests(batch, 2), 3)


def test_a_kept_path_replay_reads_the_capture_parents_after_a_copied_one():
    """A replay whose ``parents`` were copied into the capture's tensor, then a kept replay
    with the capture's tensor itself: rows the draft loop fills in it are read, not compared
    with the earlier replay's tensor."""
    torch.manual_seed(3)
    r = _runner("mha", [9, 15], 2, 3)
    backend = TritonDecode(r, 2, 3, tree_mode="path")
    backend.init_cuda_graph_state(2, 4)
    first = place_decode_round(r, [6, 12], 2, 3, 1, "path")
    backend.init_forward_metadata_capture_cuda_graph(first)
    own = DraftBatch(first.req_pool_indices, first.seq_lens, first.out_cache_loc,
                     torch.zeros_like(first.parents))
    backend.init_forward_metadata_replay_cuda_graph(own, 2)  # copied into the capture's
    backend.init_forward_metadata_replay_cuda_graph(first, 2)  # kept: the capture's tensor
    layer = AttentionLayer(0, 0.25)
    for step in range(2):
        if step:
            first.parents[step] = torch.tensor([[1, 0], [1, 1]])
        q, k, v = (torch.randn(4, *shape, dtype=torch.bfloat16) for shape in ((4, 16),
                                                                                (2, 16), (2, 16)))
        out = backend.forward(step, layer, q, k, v)
        want = reference_decode(r, layer, q, first, step, "path")
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_new_graph_state_drops_the_kept_calls():
    """``init_cuda_graph_state`` makes new fixed buffers: the calls kept with views of the
    old ones are dropped."""
    backend, _, _ = _graph_backend("mha", "mha", 2, 2, 2)
    assert len(backend._replays) == 1
    backend.init_cuda_graph_state(2, 4)
    assert backend._replays == {}


# --- KernelLaunch ------------------------------------------------------------------------------

class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class _Compiled:
    """A stand-in ``CompiledKernel``: records its direct launches."""

    def __init__(self, signature):
        self.src = type("Src", (), {"signature": signature})()
        self.function, self.packed_metadata, self.runs = "fn", "meta", []

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A stand-in ``JITFunction`` ``k(A, B, n, BLOCK: constexpr)``: ``kernel[grid](...)``
    returns its compiled kernel, as Triton's does."""

    params = [_Param("A", False), _Param("B", False), _Param("n", False),
              _Param("BLOCK", True)]

    def __init__(self, compiled):
        self.compiled, self.launches = compiled, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled
        return launch


class _Hooks:
    def __init__(self):
        self.calls = []


def _knobs(monkeypatch):
    hooks = type("Runtime", (), {"launch_enter_hook": _Hooks(), "launch_exit_hook": _Hooks()})
    monkeypatch.setattr(kernel_launch, "_knobs", type("Knobs", (), {"runtime": hooks}))
    device = [0]
    monkeypatch.setattr(kernel_launch, "_driver_functions",
                        lambda: (lambda: device[0], lambda index: 1000 + index))
    return hooks, device


def test_kernel_launch_runs_the_kept_kernel_with_every_bound_argument(monkeypatch):
    hooks, device = _knobs(monkeypatch)
    compiled = _Compiled({"A": "*i64", "B": "*i32", "n": "i32", "BLOCK": "constexpr"})
    kernel = _Kernel(compiled)
    launch = kernel_launch.KernelLaunch(kernel, (6,), (7,), {"BLOCK": 8, "num_warps": 1})
    launch("a0", "b0")  # the ordinary launch, which returns the compiled kernel
    assert kernel.launches == [((6,), ("a0", "b0", 7), {"BLOCK": 8, "num_warps": 1})]
    assert launch.direct
    launch("a1", "b1")
    assert compiled.runs == [(6, 1, 1, 1000, "fn", "meta", None, None, None, "a1", "b1", 7, 8)]
    hooks.launch_enter_hook.calls.append(print)  # a profiler's hook: the ordinary launch
    launch("a2", "b2")
    hooks.launch_enter_hook.calls.clear()
    device[0] = 1  # another current device: the ordinary launch
    launch("a3", "b3")
    assert len(kernel.launches) == 3 and len(compiled.runs) == 1


def test_kernel_launch_passes_its_trailing_tensors_as_addresses(monkeypatch):
    """Triton's launcher asks the driver about every tensor argument's pointer; the trailing
    tensors, checked by the first (ordinary) launch, go to the direct launches as addresses,
    and the launch holds them."""
    _knobs(monkeypatch)
    compiled = _Compiled({"A": "*i64", "B": "*i32", "n": "i32", "BLOCK": "constexpr"})
    kernel = _Kernel(compiled)
    buf = torch.arange(4, dtype=torch.int32)
    launch = kernel_launch.KernelLaunch(kernel, (6,), (buf, 7), {"BLOCK": 8})
    launch("a0")
    assert kernel.launches[0][1][1] is buf
    launch("a1")
    assert compiled.runs == [(6, 1, 1, 1000, "fn", "meta", None, None, None, "a1",
                              buf.data_ptr(), 7, 8)]
    assert launch.tail[0] is buf


@pytest.mark.parametrize("compiled", [
    None,  # the interpreter returns no compiled kernel
    _Compiled({"A": "*i64", "B": "*i32", "n": "i32"}),  # a launcher without the constexprs
])
def test_kernel_launch_keeps_the_ordinary_launch_otherwise(monkeypatch, compiled):
    _knobs(monkeypatch)
    kernel = _Kernel(compiled)
    launch = kernel_launch.KernelLaunch(kernel, (2, 3), (7,), {"BLOCK": 8})
    for _ in range(2):
        launch("a", "b")
    assert not launch.direct and len(kernel.launches) == 2


def _no_slot0_round(runner: DraftRunner, seq: list[int], ext: list[int], rows: list[int],
                    first: int):
    """An extend batch on request rows ``rows`` whose tokens take consecutive slots from
    ``first`` (never slot 0, the padding's)."""
    from specattn.data import DraftExtendBatch

    new, at = [], first
    for row, n, e in zip(rows, seq, ext):
        runner.req_to_token[row, :n] = torch.arange(at, at + n, dtype=torch.int32)
        new.append(torch.arange(at + n - e, at + n))
        at += n
    return DraftExtendBatch(torch.tensor(rows), torch.tensor(seq), torch.tensor(ext),
                            torch.cat(new))


@pytest.mark.parametrize("seq,ext", [([9], [2]), ([6, 5, 12], [2, 2, 3])],
                         ids=["fewer-requests", "fewer-tokens"])
def test_extend_replay_smaller_than_its_capture_is_padded(monkeypatch, seq, ext):
    """A captured extend graph (3 requests, 8 new tokens) replays a smaller round: the
    captured launches (recorded here and run again after the replay call, as a graph
    replays them) find padding requests that do nothing and padding tokens in slot 0. The
    metadata had kept the capture round's requests and slots past the batch, and the
    replay wrote its leftover rows into the capture round's KV."""
    from specattn.backends.torch_ref import reference_extend
    from specattn.layer import AttentionLayer

    torch.manual_seed(3)
    runner = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=128, max_reqs=8,
                             max_context_len=32, dtype=torch.float32, device=DEV)
    for pool in runner.k_buffer + runner.v_buffer:
        pool.copy_(torch.randn(pool.shape))
    layer = AttentionLayer(0, 16 ** -0.5)
    calls = []
    real = launchers.attention
    monkeypatch.setattr(launchers, "attention", lambda *a, **kw: calls.append((a, kw))
                        or real(*a, **kw))
    backend = TritonExtend(runner, topk=4, num_steps=3)
    capture = _no_slot0_round(runner, [8, 9, 7], [3, 2, 3], [1, 2, 3], first=10)
    backend.init_cuda_graph_state(3, 8)
    backend.init_forward_metadata_capture_cuda_graph(capture)
    q, k, v = (torch.randn(8, h, 16) for h in (4, 2, 2))
    backend.forward(layer, q, k, v)
    args, kwargs = calls[-1]
    rows = [4, 5, 6][:len(seq)]
    batch = _no_slot0_round(runner, seq, ext, rows, first=60)
    kept = [pool.clone() for pool in runner.k_buffer + runner.v_buffer]
    backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape))
    out = real(*args, **kwargs)  # the graph's replay
    tokens = int(sum(ext))
    written = torch.cat([batch.out_cache_loc, torch.zeros(1, dtype=torch.long)])
    for before, after in zip(kept, runner.k_buffer + runner.v_buffer):
        others = torch.ones(before.shape[0], dtype=torch.bool)
        others[written] = False
        assert torch.equal(before[others], after[others])  # only its slots and slot 0
    torch.testing.assert_close(runner.k_buffer[0][batch.out_cache_loc], k[:tokens])
    want = reference_extend(runner, layer, q[:tokens], batch)
    torch.testing.assert_close(out[:tokens], want, atol=1e-5, rtol=1e-5)


def test_extend_replay_of_more_tokens_than_its_capture_or_into_slot_0_is_refused():
    runner = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=128, max_reqs=8,
                             max_context_len=32, dtype=torch.float32, device=DEV)
    backend = TritonExtend(runner, topk=4, num_steps=3)
    backend.init_cuda_graph_state(3, 16)
    backend.init_forward_metadata_capture_cuda_graph(
        _no_slot0_round(runner, [8, 9, 7], [3, 2, 3], [1, 2, 3], first=10))
    bigger = _no_slot0_round(runner, [8, 9, 7], [3, 3, 3], [4, 5, 6], first=60)
    with pytest.raises(InvalidInputError, match=r"^batch: expected at most 8 new tokens "
                                                r"\(the capture at bs=3; .*got 9 tokens$"):
        backend.init_forward_metadata_replay_cuda_graph(bigger, 3)
    smaller = _no_slot0_round(runner, [8], [3], [4], first=0)  # a prefix token in slot 0
    with pytest.raises(InvalidInputError, match=r"^runner.req_to_token: expected no prefix "
                                                r"token in slot 0 in a replay padded"):
        backend.init_forward_metadata_replay_cuda_graph(smaller, 3)
