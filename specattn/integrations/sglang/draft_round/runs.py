"""SGLang's draft round run over a container (stock or the plugin's): the draft model with
records, the factory with or without the plugin's hooks, eager rounds and the graph runner
(on a CPU with ``EagerGraphBackend``)."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator, Optional
from unittest import mock

import torch

from ....errors import InvalidInputError
from .fixture import Fixture

SPECATTN_ENV_KEYS = ("SPECATTN_SGLANG", "SPECATTN_SGLANG_BACKEND", "SPECATTN_SGLANG_TREE_MODE",
                     "SPECATTN_SGLANG_OPTIONS")


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
