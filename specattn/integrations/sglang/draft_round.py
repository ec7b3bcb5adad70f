"""SGLang's own EAGLE draft round, stock and through the specattn plugin (imports SGLang).

Everything here is SGLang 0.5.23's: the mock model runner and pools of its attention test kit
(``sglang.test.kits.attention_unittest``: ``MHATokenToKVPool`` / ``MLATokenToKVPool``, a real
``RadixAttention`` layer), ``DraftBackendFactory`` (with the plugin's hooks applied through
SGLang's ``HookRegistry``, or without), the real ``EagleDraftWorker.draft_forward`` (the kit's
worker harness) and ``EAGLEDraftCudaGraphRunner`` (capture, then ``execute``: its host
preparation and the graph replay). What this module adds: long prefixes written straight into
the pools (random KV; the kit fills them token by token), SGLang's per-branch draft slots for
page size > 1, a draft model whose LM head is float32 (the kit's, with logits that near-ties
flip less) and whose MLA KV store gets a contiguous ``out_cache_loc`` (``_contiguous_kv_store``),
records of every step's attention input and output, logits and KV, and the comparisons:

- ``compare``: two runs of the same round (draft tokens; each step's attention output, the
  KV it wrote and the logits, relative to the reference's largest magnitude). A request whose
  tokens differ passes only where the logits that chose them agree within the tolerance (a
  rounding-level near-tie; counted); its later steps are not compared.
- ``check_tree``: a run against a float32 attention computed from the recorded queries and
  the pools, for ``lane`` (each lane's own slots) or ``path`` (each token's ancestors, from the
  parents the plugin recorded), with the rows where the two differ counted; ``UPSTREAM``:
  SGLang backends that read something else, checked against a model of what they read.

On a CPU (tests) the graph runner is driven with an eager stand-in for its CUDA-graph backend
(``EagerGraphBackend``: capture runs the body once, replay runs it again), so everything but
the capture itself runs there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch

from ...errors import BackendUnavailableError, InvalidInputError
from . import stubs

__all__ = ["RoundCase", "Fixture", "Record", "Verdict", "build_fixture", "sglang_hooks",
           "make_container", "run_eager", "capture_graph", "capture_graph_recorded",
           "run_graph", "execute_tree", "compare", "check_tree", "tree_reference",
           "time_graph_round", "time_steps", "time_pair", "served_by", "install_stubs",
           "SPECATTN_ENV_KEYS", "draft_positions", "DraftModel", "EagerGraphBackend",
           "rel_err", "kv_reads", "tree_verdict", "UPSTREAM", "upstream_check", "perturbed"]

SPECATTN_ENV_KEYS = ("SPECATTN_SGLANG", "SPECATTN_SGLANG_BACKEND", "SPECATTN_SGLANG_TREE_MODE",
                     "SPECATTN_SGLANG_OPTIONS")


def install_stubs(gpu: bool) -> list[str]:
    """Stand-ins for what SGLang imports but cannot have here (``stubs``). On a GPU host:
    ``sgl_kernel`` (``sgl_kernel.scalar_type`` left missing: SGLang falls back without it;
    ``sgl_kernel.utils.is_arch_support_pdl``, which SGLang's Triton backend asks at start, is
    its pure-Python check: a CUDA device of compute capability 9.0 or more), ``IPython``,
    ``datasets``; on a CPU: ``torchvision``, ``datasets``."""
    if not gpu:
        return stubs.install(stubs.CPU_PACKAGES)

    def is_arch_support_pdl() -> bool:
        if torch.version.hip:
            return False
        return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9

    return stubs.install(stubs.GPU_PACKAGES + stubs.CPU_PACKAGES,
                         shims={"sgl_kernel.utils.is_arch_support_pdl": is_arch_support_pdl},
                         absent=("sgl_kernel.scalar_type",))


# --- the case and its fixture ------------------------------------------------------------------

@dataclass(frozen=True)
class RoundCase:
    """One draft round. ``shape``: ``(H_q, H_kv, D)`` (MHA) or ``(H, kv_lora_rank, rope)``
    (MLA); ``capture_bs``: the graph runner's one captured batch size (>= B; more pads)."""

    model: str
    lengths: tuple[int, ...]
    topk: int
    steps: int
    page_size: int = 1
    shape: tuple[int, int, int] = (32, 8, 128)
    hidden: int = 256
    vocab: int = 64
    capture_bs: Optional[int] = None

    def __post_init__(self) -> None:
        if self.model not in ("mha", "mla"):
            raise InvalidInputError("model", "'mha' or 'mla'", repr(self.model))
        if self.steps < 2 or self.topk < 1 or not self.lengths:
            raise InvalidInputError("(steps, topk, lengths)", "steps >= 2, topk >= 1, a "
                                    "request", (self.steps, self.topk, self.lengths))

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def graph_bs(self) -> int:
        return max(self.capture_bs or self.batch, self.batch)

    @property
    def draft_tokens(self) -> int:
        return self.steps + 1 if self.topk == 1 else self.topk * (self.steps - 1) + 1


def draft_positions(seq_len: int, topk: int, steps: int, page: int) -> list[list[int]]:
    """Positions in ``R_b`` of lane ``j``'s step-``t`` slot, as SGLang allocates them: after
    the prefix (``page == 1`` or ``topk == 1``), else per-branch pages after the last full
    prefix page (each branch's first page starts with a copy of the partial prefix page)."""
    if page == 1 or topk == 1:
        return [[seq_len + j * steps + t for t in range(steps)] for j in range(topk)]
    last = seq_len % page
    base = seq_len - last
    pages = (last + steps + page - 1) // page
    return [[base + j * pages * page + last + t for t in range(steps)] for j in range(topk)]


def _max_context(lengths, topk_max: int, steps: int, page: int) -> int:
    ext = max(p for n in lengths for lane in draft_positions(n, topk_max, steps, page)
              for p in lane) + 1
    return -(-(ext + page) // page) * page  # a page multiple: slots stay page-aligned


class _KitCase:
    """The kit's ``testcase`` argument: only ``skipTest`` is used."""

    def skipTest(self, reason):  # noqa: N802 (unittest's name)
        raise BackendUnavailableError(f"SGLang's attention kit skipped the fixture: {reason}")


@dataclass
class Fixture:
    """SGLang's runner and pools for one model, batch and page size, reused by every
    backend and topk up to ``topk_max`` (``use`` reconfigures the runner)."""

    model: str
    lengths: tuple[int, ...]
    shape: tuple[int, int, int]
    page_size: int
    steps: int
    hidden: int
    vocab: int
    dtype: torch.dtype
    device: str
    kit_case: Any
    runner: Any
    module: Any
    max_context: int
    graph_bs: int
    case: Optional[RoundCase] = None
    loc: Optional[torch.Tensor] = None

    @property
    def layer(self):
        return self.module.attn if self.model == "mha" else self.module.attn_mqa

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def pools(self) -> list[torch.Tensor]:
        pool = self.runner.token_to_kv_pool
        return list(pool.kv_buffer) if self.model == "mla" else (
            list(pool.k_buffer) + list(pool.v_buffer))

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.pools()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.pools(), saved):
            t.copy_(s)

    def slot(self, b: int, pos):
        return self.page_size + b * self.max_context + pos

    def draft_rows(self) -> torch.Tensor:
        """The KV rows of the draft slots ``[B, K, S, ...]`` (MHA: K then V side by side)."""
        loc = self.loc.view(self.batch, self.case.topk, self.case.steps)
        if self.model == "mla":
            return self.pools()[0][loc].float().flatten(3)
        k, v = self.pools()
        return torch.cat([k[loc].float().flatten(3), v[loc].float().flatten(3)], dim=-1)

    def use(self, case: RoundCase, backend: str) -> Any:
        """Configure the runner for ``case`` served under SGLang's name ``backend``; write
        the draft slots into ``req_to_token``; return the kit's settings."""
        from sglang.test.kits.attention_unittest.runner_modes import (
            speculative_draft_runner as draft_kit)

        if (case.model, case.lengths, case.page_size, case.steps) != (
                self.model, self.lengths, self.page_size, self.steps) or \
                case.graph_bs > self.graph_bs:
            raise InvalidInputError("case", "the fixture's model, lengths, page size, steps "
                                    "and at most its graph batch", case)
        kit_case = dataclasses.replace(self.kit_case, backend=backend)
        settings = draft_kit.EagleDraftRunnerSettings(
            topk=case.topk, speculative_num_steps=case.steps,
            speculative_num_draft_tokens=case.draft_tokens, capture_batch_size=case.graph_bs,
            hidden_size=self.hidden, vocab_size=self.vocab, max_context_len=self.max_context,
            dtype=self.dtype, device=self.device, atol=0.0, rtol=0.0)
        draft_kit._configure_runner_for_eagle_draft(self.runner, kit_case, settings)
        self.runner.prefill_attention_backend_str = backend
        self.runner.decode_attention_backend_str = backend
        r2t = self.runner.req_to_token_pool.req_to_token
        rows, cols = [], []
        for b, n in enumerate(self.lengths):
            for lane in draft_positions(n, case.topk, case.steps, self.page_size):
                rows += [b] * len(lane)
                cols += lane
        rows_t = torch.tensor(rows, device=r2t.device)
        cols_t = torch.tensor(cols, device=r2t.device)
        r2t[rows_t, cols_t] = self.slot(rows_t, cols_t).to(r2t.dtype)
        self.loc = self.slot(rows_t, cols_t).to(torch.int64)
        self.case = case
        return settings

    def inputs(self, seed: int = 1) -> dict:
        g = torch.Generator(device="cpu").manual_seed(seed)
        bs, k = self.batch, self.case.topk
        return dict(topk_p=torch.softmax(torch.randn(bs, k, generator=g), -1).to(self.device),
                    topk_index=torch.randint(self.vocab, (bs, k), generator=g).to(self.device),
                    hidden_states=torch.randn(bs, self.hidden, generator=g).to(
                        self.device, self.dtype))

    def batch_of(self, inputs: dict):
        """The DECODE batch SGLang's ``prepare_for_draft`` hands ``draft_forward``."""
        from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode,
                                                                  ForwardBatch, ForwardMode)
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        topk = self.case.topk
        spec = EagleDraftInput(topk_p=inputs["topk_p"].clone(),
                               topk_index=inputs["topk_index"].clone(),
                               hidden_states=inputs["hidden_states"].clone(),
                               capture_hidden_mode=CaptureHiddenMode.LAST,
                               num_tokens_per_req=topk, num_tokens_for_logprob_per_req=topk)
        seq = torch.tensor(self.lengths, dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=self.batch, input_ids=None,
            req_pool_indices=torch.arange(self.batch, dtype=torch.int32, device=self.device),
            seq_lens=seq, seq_lens_cpu=seq.cpu(), out_cache_loc=self.loc.clone(),
            seq_lens_sum=sum(self.lengths), positions=seq.repeat_interleave(topk).long(),
            spec_algorithm=SpeculativeAlgorithm.EAGLE, spec_info=spec,
            capture_hidden_mode=CaptureHiddenMode.LAST)
        self.runner.kv_index_translator.bind_own_plan(fb)
        return fb


def build_fixture(model: str, lengths, *, shape, page_size: int, steps: int, topk_max: int,
                  graph_bs: Optional[int] = None, hidden: int = 256, vocab: int = 64,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                  backend: str = "triton", seed: int = 0) -> Fixture:
    """SGLang's kit fixture (runner, pools sized from the lengths, the attention module),
    then the prefixes: ``req_to_token`` rows ``page + b * max_context + pos`` and random KV in
    every pool row (the kit writes prefixes token by token; here they are written at once)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import (
        dense_attention as dense_kit, mla_attention as mla_kit)

    lengths = tuple(int(n) for n in lengths)
    bs = len(lengths)
    graph_bs = max(graph_bs or bs, bs)
    max_ctx = _max_context(lengths, topk_max, steps, page_size)
    a, b, c = shape
    common = dict(name=f"specattn_{model}", backend=backend, forward_mode=ForwardMode.DECODE,
                  num_heads=a, page_size=page_size, prefix_lens=(1,) * bs)
    build = dict(hidden_size=hidden, max_context_len=max_ctx, dtype=dtype, device=device,
                 disable_cuda_graph=False, runner_batch_size=graph_bs,
                 loc_layout="contiguous")
    if model == "mla":
        kit_case = mla_kit.MLAAttentionCase(**common)
        fx = mla_kit.build_mla_attention_fixture(_KitCase(), kit_case, kv_lora_rank=b,
                                                 qk_rope_head_dim=c, **build)
    else:
        kit_case = dense_kit.DenseAttentionCase(num_kv_heads=b, **common)
        fx = dense_kit.build_dense_attention_fixture(_KitCase(), kit_case, head_dim=c, **build)
    out = Fixture(model, lengths, tuple(shape), page_size, steps, hidden, vocab, dtype, device,
                  kit_case, fx.runner, fx.actual_module, max_ctx, graph_bs)
    if model == "mla":
        _contiguous_kv_store(out.module)
    r2t = out.runner.req_to_token_pool.req_to_token
    for i, n in enumerate(lengths):
        r2t[i, :n] = out.slot(i, torch.arange(n, device=r2t.device)).to(r2t.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pool in out.pools():  # chunks: a float32 randn of a 4 GiB pool would double it
        flat = pool.view(pool.shape[0], -1)
        for start in range(0, flat.shape[0], 1 << 16):
            part = flat[start:start + (1 << 16)]
            part.copy_(torch.randn(part.shape, generator=gen, device=device,
                                   dtype=torch.float32) * 0.5)
    return out


def _contiguous_kv_store(module) -> None:
    """The kit's MLA module stores each step's KV itself (``set_mla_kv_buffer`` with the
    step's ``out_cache_loc``, then attention with ``save_kv_cache=False``). ``draft_forward``
    hands step ``i`` a strided view, ``loc.view(B, K, S).permute(2, 0, 1).reshape(S, -1)[i]``
    (stride ``S``: ``per_step_draft_out_cache_loc``), and SGLang 0.5.23's store kernels on a
    GPU index ``loc`` as contiguous (the SM90 JIT ``set_mla_kv_buffer.cuh``:
    ``params.loc[warp]``; the Triton ``set_mla_kv_buffer_kernel``: ``loc_ptr + pid_loc``).
    Row ``r`` of step ``i`` then lands in slot ``loc[i + r]`` instead of ``loc[r * S + i]``:
    a graph replay's padded rows overwrite real requests' draft slots, and a request whose
    tokens diverged writes into another request's. The store gets a contiguous copy of the
    view (as ``draft_forward`` makes one for Qwen3-MoE MTP's fused store,
    ``eagle_worker_v2.py:823-829``), so each row lands in its own slot whichever backend
    serves the attention (docs/sglang.md)."""
    store = module.write_kv_cache
    module.write_kv_cache = lambda locs, k_nope, k_rope: store(locs.contiguous(), k_nope, k_rope)


# --- the draft model, with records ---------------------------------------------------------------

class DraftModel:
    """The kit's tiny EAGLE draft model (embedding, the fixture's attention module, LM head)
    with a float32 LM head; records each forward's ``input_ids`` and logits."""

    def __init__(self, fx: Fixture, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.module = fx.module
        self.token_embed = torch.nn.Embedding(fx.vocab, fx.hidden, dtype=fx.dtype,
                                              device=fx.device)
        self.lm_head = torch.nn.Linear(fx.hidden, fx.vocab, bias=False, dtype=torch.float32,
                                       device=fx.device)
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, forward_batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        if not forward_batch.forward_metadata_ready:
            raise InvalidInputError("forward_batch.forward_metadata_ready",
                                    "True (a pre-planned draft batch)", False)
        hidden = forward_batch.spec_info.hidden_states + self.token_embed(
            forward_batch.input_ids)
        hidden = self.module(hidden, forward_batch)
        logits = self.lm_head(hidden.float())
        self.records.append((forward_batch.input_ids.detach().clone(), logits.detach().clone()))
        return SimpleNamespace(logits_output=LogitsProcessorOutput(next_token_logits=logits,
                                                                   hidden_states=hidden))


@dataclass
class Record:
    """One round: the tree outputs, and per forward (``S - 1``) its input tokens, logits,
    attention query and output; the draft slots' KV after the round; the parents (path)."""

    tree: tuple
    input_ids: list
    logits: list
    queries: list
    outputs: list
    kv: torch.Tensor
    parents: Optional[torch.Tensor] = None
    steps_inputs: list = field(default_factory=list)  # (backend, q, k, v, kwargs, batch)
    pools_at: list = field(default_factory=list)  # per forward: the pools as attention read them


@contextlib.contextmanager
def _recording(fx: Fixture, model: DraftModel, pools_at: Optional[list] = None):
    """Records each attention call's inputs and output (and, given ``pools_at``, a copy of
    the pools as the call left them: what it read, its new KV included)."""
    from sglang.srt.model_executor.forward_context import get_forward_context

    calls, outputs = [], []

    def pre(module, args, kwargs):
        q, k, v, fb = args[:4]
        kw = dict(kwargs)
        if len(args) > 4:
            kw["save_kv_cache"] = args[4]
        calls.append((get_forward_context().attn_backend, q.detach().clone(),
                      None if k is None else k.detach().clone(),
                      None if v is None else v.detach().clone(), kw,
                      copy.copy(fb)))

    def post(module, args, kwargs, out):
        outputs.append(out.detach().clone())
        if pools_at is not None:  # after the call: the backend may write the new KV itself
            pools_at.append([p.clone() for p in fx.pools()])

    h1 = fx.layer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = fx.layer.register_forward_hook(post, with_kwargs=True)
    model.records.clear()
    try:
        yield calls, outputs
    finally:
        h1.remove()
        h2.remove()


def _record(fx: Fixture, tree, calls, outputs, model: DraftModel, container,
            pools_at: Optional[list] = None) -> Record:
    n = fx.case.steps - 1
    calls, outputs, recs = calls[-n:], outputs[-n:], model.records[-n:]
    if len(outputs) != n or len(recs) != n:
        raise InvalidInputError("the draft round", f"{n} attention calls",
                                f"{len(outputs)} calls, {len(recs)} forwards")
    adapter = getattr(container, "adapter", None)
    parents = getattr(adapter, "parents", None)
    bs = fx.batch
    return Record(tuple(t[:bs].clone() if t is not None else None for t in tree[:3]),
                  [r[0] for r in recs], [r[1] for r in recs], [c[1] for c in calls],
                  outputs, fx.draft_rows(),
                  None if parents is None else parents[:, :bs].clone(), list(calls),
                  (pools_at or [])[-n:])


# --- SGLang's factory with or without the plugin -------------------------------------------------

@contextlib.contextmanager
def sglang_hooks(env: Optional[dict]) -> Iterator[None]:
    """SGLang's ``DraftBackendFactory`` with the specattn plugin's hooks applied (``env``:
    the opt-in variables, e.g. ``{"SPECATTN_SGLANG": "1"}``) or stock (``None``); every
    patched target and variable is restored afterwards."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import draft_utils, spec_utils

    import specattn.integrations.sglang.plugin as plugin

    saved_env = {k: os.environ.get(k) for k in SPECATTN_ENV_KEYS}
    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    factory = draft_utils.DraftBackendFactory
    originals = {name: factory.__dict__[name]
                 for name in ("create_decode_backend", "create_draft_extend_backend")}
    select = spec_utils.select_top_k_tokens
    import sys

    holders = [m for m in list(sys.modules.values())
               if isinstance(getattr(m, "__dict__", None), dict)
               and m.__dict__.get("select_top_k_tokens") is select]
    try:
        for key in SPECATTN_ENV_KEYS:
            os.environ.pop(key, None)
        if env is not None:
            os.environ.update(env)
            HookRegistry.reset()
            plugin.register()
            HookRegistry.apply_hooks()
        yield
    finally:
        for name, fn in originals.items():
            setattr(factory, name, fn)
        for module in holders:
            module.select_top_k_tokens = select
        spec_utils.select_top_k_tokens = select
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_container(fx: Fixture, env: Optional[dict] = None):
    """What ``EagleDraftWorker.init_attention_backend`` builds for the fixture's case."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    with sglang_hooks(env):
        container = DraftBackendFactory(fx.runner, fx.case.topk,
                                        fx.case.steps).create_decode_backend()
    return container


def _worker(fx: Fixture, container, settings, model: DraftModel):
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_draft_runner as draft_kit)

    fx.runner.draft_attn_backend = container
    return draft_kit._EagleDraftWorkerHarness(
        fixture=SimpleNamespace(runner=fx.runner), draft_attn_backend=container,
        model_forward=model, settings=settings)


def run_eager(fx: Fixture, container, settings, model: DraftModel, inputs: dict, *,
              keep_pools: bool = False) -> Record:
    """SGLang's ``draft_forward`` over ``container``, eagerly (one metadata call, S - 1
    forwards). ``keep_pools``: the record keeps a copy of the pools per forward, as the
    attention call read them (``tree_reference`` then attends to exactly those)."""
    worker = _worker(fx, container, settings, model)
    batch = fx.batch_of(inputs)
    pools_at = [] if keep_pools else None
    with _recording(fx, model, pools_at) as (calls, outputs), torch.no_grad():
        container.init_forward_metadata(batch)
        batch.mark_forward_metadata_ready()
        tree = worker.draft_forward(batch)
    _sync(fx.device)
    return _record(fx, tree, calls, outputs, model, container, pools_at)


# --- the graph runner ---------------------------------------------------------------------------

class EagerGraphBackend:
    """A CPU stand-in for SGLang's CUDA-graph backend: capture runs the body once and keeps
    it, replay runs it again (so the runner's buffers, padding and metadata calls are
    exercised; only the graph itself is not)."""

    def __init__(self, runner) -> None:
        self._bodies: dict = {}

    @contextlib.contextmanager
    def capture_session(self, stream):
        yield

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
        forward_fn()
        if post_warmup_hook is not None:
            post_warmup_hook()
        self._bodies[shape_key] = forward_fn

    def can_run(self, forward_batch, shape_key) -> bool:
        return shape_key in self._bodies

    def replay(self, shape_key, static_forward_batch, **kwargs):
        return self._bodies[shape_key]()

    def cleanup(self) -> None:
        self._bodies.clear()


@contextlib.contextmanager
def _cpu_graph_patches():
    from sglang.srt.speculative import eagle_draft_cuda_graph_runner as egr

    dcg = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"

    @contextlib.contextmanager
    def no_capture(stream=None):
        yield SimpleNamespace(stream=stream)

    with mock.patch.object(egr, "resolve_decode_backend", EagerGraphBackend), \
            mock.patch(f"{dcg}.graph_capture", no_capture), \
            mock.patch(f"{dcg}.get_or_create_global_graph_capture_stream",
                       lambda: SimpleNamespace(cpu=True)):
        yield


def capture_graph(fx: Fixture, container, settings, model: DraftModel):
    """SGLang's ``EAGLEDraftCudaGraphRunner`` over ``container``, captured at
    ``case.graph_bs`` (the kit's single-rank capture; on a CPU, ``EagerGraphBackend``)."""
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_draft_runner as draft_kit)

    worker = _worker(fx, container, settings, model)
    cpu = contextlib.nullcontext() if fx.device == "cuda" else _cpu_graph_patches()
    with cpu, torch.no_grad():
        graph = draft_kit._capture_eagle_draft_graph_runner(worker, container, settings)
    return graph


def run_graph(fx: Fixture, graph, model: DraftModel, inputs: dict, container) -> Record:
    """One ``execute`` (host preparation + replay). The records are the capture's (on a GPU
    the clones are graph nodes, refreshed by the replay) or the replay's (CPU)."""
    batch = fx.batch_of(inputs)
    if not graph.can_run_graph(batch):
        raise InvalidInputError("EAGLEDraftCudaGraphRunner.can_run_graph", "True", False)
    with _recording(fx, model) as (calls, outputs), torch.no_grad():
        if fx.device == "cuda":
            calls[:], outputs[:] = graph._specattn_calls, graph._specattn_outputs
            model.records[:] = graph._specattn_records
        cpu = contextlib.nullcontext() if fx.device == "cuda" else _cpu_graph_patches()
        with cpu:
            tree = graph.execute(batch)
        _sync(fx.device)
        return _record(fx, tree, calls, outputs, model, container)


def execute_tree(fx: Fixture, graph, inputs: dict) -> tuple:
    """One ``execute`` of a runner captured without records: the tree outputs."""
    with torch.no_grad():
        tree = graph.execute(fx.batch_of(inputs))
    _sync(fx.device)
    return tuple(t[:fx.batch].clone() if t is not None else None for t in tree[:3])


def capture_graph_recorded(fx: Fixture, container, settings, model: DraftModel):
    """``capture_graph`` with the records of the capture kept on the runner (GPU replays
    refresh them)."""
    with _recording(fx, model) as (calls, outputs):
        graph = capture_graph(fx, container, settings, model)
        graph._specattn_calls, graph._specattn_outputs = list(calls), list(outputs)
        graph._specattn_records = list(model.records)
    return graph


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def perturbed(rec: Record) -> Record:
    """A copy of ``rec`` whose first step's attention output is wrong by 10% of its scale
    (a comparison must fail it)."""
    bad = copy.copy(rec)
    bad.outputs = [o.clone() for o in rec.outputs]
    bad.outputs[0] += 0.1 * bad.outputs[0].abs().max()
    return bad


# --- comparisons ---------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    requests: int
    tokens_equal: int           # requests whose draft tokens are equal
    near_ties: int              # requests whose tokens differ at a rounding-level near-tie
    out_err: float = 0.0        # max over compared steps: max |got - ref| / max |ref|
    kv_err: float = 0.0
    logit_err: float = 0.0
    problems: list = field(default_factory=list)

    @property
    def summary(self) -> str:
        ties = f", {self.near_ties} near-tie" if self.near_ties else ""
        text = (f"tokens {self.tokens_equal}/{self.requests}{ties}; attn {self.out_err:.1e}, "
                f"KV {self.kv_err:.1e}, logits {self.logit_err:.1e}")
        return text if self.ok else text + "; " + "; ".join(self.problems[:3])


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float32 (``inf`` if ``got`` is not finite)."""
    got, ref = got.float(), ref.float()
    if got.shape != ref.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _first_divergence(ref: Record, got: Record, b: int, topk: int) -> Optional[int]:
    """The first selection (1..S-1) whose tokens differ for request ``b``, or None."""
    rows = slice(b * topk, (b + 1) * topk)
    for i, (x, y) in enumerate(zip(ref.input_ids, got.input_ids)):
        if not torch.equal(x[rows], y[rows]):
            return max(i, 1)  # selection 0 takes the given top-k: equal unless broken
    if not all(torch.equal(x[b], y[b]) for x, y in zip(ref.tree, got.tree) if x is not None):
        return len(ref.input_ids)  # the last selection, from the last forward's logits
    return None


def compare(ref: Record, got: Record, topk: int, tol: float) -> Verdict:
    """``got`` against ``ref`` (same inputs): see the module doc."""
    bs = ref.tree[2].shape[0]
    steps = len(ref.outputs)
    equal = ties = 0
    out_err = kv_err = logit_err = 0.0
    problems = []
    compared = [steps] * bs  # forwards of each request that saw equal tokens
    for b in range(bs):
        rows = slice(b * topk, (b + 1) * topk)
        d = _first_divergence(ref, got, b, topk)
        if d is None:
            equal += 1
        else:
            compared[b] = d
            err = rel_err(got.logits[d - 1][rows], ref.logits[d - 1][rows])
            logit_err = max(logit_err, err)
            if err <= tol:
                ties += 1
            else:
                problems.append(f"request {b}: tokens differ at step {d} with logits "
                                f"{err:.2g} apart")
    for i in range(steps):
        idx = [b for b in range(bs) if compared[b] > i]
        if not idx:
            continue
        rows = torch.cat([torch.arange(b * topk, (b + 1) * topk) for b in idx])
        rows = rows.to(ref.outputs[i].device)
        out_err = max(out_err, rel_err(got.outputs[i][rows], ref.outputs[i][rows]))
        logit_err = max(logit_err, rel_err(got.logits[i][rows], ref.logits[i][rows]))
        sel = torch.tensor(idx, device=ref.kv.device)
        kv_err = max(kv_err, rel_err(got.kv[sel, :, i], ref.kv[sel, :, i]))
    for name, err in (("attention output", out_err), ("KV", kv_err), ("logits", logit_err)):
        if not err <= tol and not (name == "logits" and problems):
            problems.append(f"{name} {err:.2g} off (tolerance {tol:g})")
    return Verdict(not problems, bs, equal, ties, out_err, kv_err, logit_err, problems)


def _ancestors(parents: Optional[torch.Tensor], b: int, lane: int, step: int,
               mode: str) -> list[int]:
    """Lane of each step ``0..step`` on lane ``lane``'s history (``lane``) or its token's
    ancestor chain (``path``: ``parents[t][b, x]`` is the lane at ``t - 1`` of the token of
    lane ``x`` at step ``t``)."""
    chain = [lane]
    for t in range(step, 0, -1):
        chain.append(int(parents[t, b, chain[-1]]) if mode == "path" else lane)
    return chain[::-1]


def kv_reads(lengths, topk: int, step: int, mode: str,
             parents: Optional[torch.Tensor] = None) -> list[list[tuple]]:
    """What row ``b * topk + j`` of step ``step`` attends to, as segments ``("prefix", b',
    lo, hi)`` (positions ``lo:hi`` of request ``b'``'s prefix) and ``("draft", b', lane, t)``:

    - ``lane``: its prefix and its lane's draft tokens ``0..step``; ``path``: its prefix and
      its token's ancestors (``parents``);
    - ``prefix``: its prefix alone (SGLang's FlashInfer MLA draft step, eager: ``UPSTREAM``);
    - ``packed`` (``topk`` 1): ``lengths[b]`` entries from offset ``sum(lengths[:b])`` of the
      requests' ``prefix + step + 1`` draft ids laid end to end (the same backend's replay)."""
    rows = []
    for b, n in enumerate(lengths):
        for j in range(topk):
            if mode == "packed":
                layout = [seg for bb in range(b + 1) for seg in
                          [("prefix", bb, 0, lengths[bb])]
                          + [("draft", bb, 0, t) for t in range(step + 1)]]
                rows.append(_window(layout, sum(lengths[:b]), n))
                continue
            segs = [("prefix", b, 0, n)]
            if mode != "prefix":
                segs += [("draft", b, lane, t)
                         for t, lane in enumerate(_ancestors(parents, b, j, step, mode))]
            rows.append(segs)
    return rows


def _window(layout: list, start: int, count: int) -> list:
    """The segments of ``layout`` covering its entries ``start:start + count``."""
    out, pos = [], 0
    for seg in layout:
        size = seg[3] - seg[2] if seg[0] == "prefix" else 1
        lo, hi = max(start, pos), min(start + count, pos + size)
        if lo < hi:
            out.append(("prefix", seg[1], seg[2] + lo - pos, seg[2] + hi - pos)
                       if seg[0] == "prefix" else seg)
        pos += size
    return out


def tree_reference(fx: Fixture, rec: Record, step: int, mode: str) -> torch.Tensor:
    """Float32 attention of step ``step`` from the recorded queries over what ``kv_reads``
    says each row reads in ``mode``: prefixes from the pools, draft KV as that call saw it
    (``rec.pools_at``) or else as the round left it (``rec.kv``; each draft slot is written
    once, at its step, so the later steps did not change what this one read)."""
    case, layer = fx.case, fx.layer
    topk = case.topk
    r2t = fx.runner.req_to_token_pool.req_to_token
    a, b_, c = fx.shape
    pools = rec.pools_at[step] if rec.pools_at else fx.pools()
    if rec.pools_at:  # the draft rows as this call read them, not as the round left them
        loc = fx.loc.view(fx.batch, topk, case.steps)
        kv = (pools[0][loc].float().flatten(3) if fx.model == "mla" else torch.cat(
            [pools[0][loc].float().flatten(3), pools[1][loc].float().flatten(3)], dim=-1))
    else:
        kv = rec.kv
    npools = 1 if fx.model == "mla" else 2  # MLA: one [kv_lora_rank + rope] buffer
    if fx.model == "mla":
        hq, hkv, dk, dv = a, 1, b_ + c, b_

        def split(rows):  # [n, dk] -> keys, values
            rows = rows.view(rows.shape[0], 1, dk)
            return rows, rows[..., :dv]
    else:
        hq, hkv, dk, dv = a, b_, c, c

        def split(rows):
            k, v = rows[:, :hkv * dk], rows[:, hkv * dk:]
            return k.reshape(-1, hkv, dk), v.reshape(-1, hkv, dv)

    def rows_of(seg):
        if seg[0] == "draft":
            return kv[seg[1], seg[2], seg[3]][None]
        slots = r2t[seg[1], seg[2]:seg[3]].long()
        return torch.cat([p[slots].float().flatten(1) for p in pools[:npools]], dim=-1)

    reads = kv_reads(fx.lengths, topk, step, mode, rec.parents)
    q = rec.queries[step][:len(reads)].float()
    q = q.view(q.shape[0], hq, dk)
    out = torch.empty(q.shape[0], hq, dv, device=q.device)
    group = hq // hkv
    for r, segs in enumerate(reads):
        keys, vals = split(torch.cat([rows_of(seg) for seg in segs]))
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r], keys) * layer.scaling
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out.flatten(1)


def check_tree(fx: Fixture, rec: Record, mode: str, tol: float) -> tuple[bool, float, int, int]:
    """``rec``'s attention outputs (a graph's padded rows left out) against
    ``tree_reference`` in ``mode``; returns (ok, max error, rows whose path reference differs
    from the lane one, rows compared)."""
    worst, differ, rows = 0.0, 0, 0
    for step in range(len(rec.outputs)):
        ref = tree_reference(fx, rec, step, mode)
        worst = max(worst, rel_err(rec.outputs[step][:ref.shape[0]].flatten(1), ref))
        if rec.parents is not None and step > 0:
            lane = tree_reference(fx, rec, step, "lane")
            scale = ref.abs().max().clamp_min(1e-6)
            differ += int(((ref - lane).abs().amax(-1) / scale > tol).sum())
        rows += ref.shape[0]
    return worst <= tol, worst, differ, rows


def tree_verdict(fx: Fixture, rec: Record, mode: str, tol: float) -> Verdict:
    """``check_tree`` as a ``Verdict`` (``path``: the rows that differ from lane attention
    are noted, and none differing at ``topk`` > 1 fails: the tree was not used)."""
    ok, err, differ, total = check_tree(fx, rec, mode, tol)
    verdict = Verdict(ok, fx.batch, fx.batch, 0, out_err=err)
    if not ok:
        verdict.problems.append(f"attention {err:.2g} off the float32 {mode} reference")
    if mode == "path":
        verdict.problems.append(f"{differ} of {total} rows differ from lane attention")
        if fx.case.topk > 1 and differ == 0:
            verdict.ok = False
            verdict.problems.insert(0, "no row differs from lane attention")
    return verdict


#: SGLang 0.5.23 draft backends whose attention is not the draft tree's: per run (``eager``,
#: ``graph``), the ``kv_reads`` mode that models what they read, and where SGLang does it.
UPSTREAM = {
    "FlashInferMLAMultiStepDraftBackend": {
        "eager": ("prefix", "SGLang's FlashInferMLAAttnBackend.init_forward_metadata plans a "
                  "decode batch without its spec_info (sglang/srt/layers/attention/"
                  "flashinfer_mla_backend.py:424-434; the draft branch is at :951), so each "
                  "draft step attends to the prefix alone"),
        "graph": ("packed", "SGLang's FlashInferMLAAttnBackend._apply_cuda_graph_metadata "
                  "plans replays with the prefix lengths (seq_lens_cpu, flashinfer_mla_backend"
                  ".py:557-562) over kv_indices holding prefix + step + 1 ids per request, so "
                  "request b reads its prefix length from the prefix-only offset"),
    },
}


def upstream_check(fx: Fixture, rec: Record, container, run: str,
                   tol: float) -> Optional[tuple[str, str, Verdict]]:
    """For SGLang's ``container`` of ``UPSTREAM``: ``(mode, where, verdict)``, ``rec``'s
    attention against the float32 model of what that backend reads in ``run``; else None."""
    known = UPSTREAM.get(type(container).__name__, {}).get(run)
    if known is None:
        return None
    return known[0], known[1], tree_verdict(fx, rec, known[0], tol)


# --- timing --------------------------------------------------------------------------------------

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
    from ...bench.harness import short_error
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
