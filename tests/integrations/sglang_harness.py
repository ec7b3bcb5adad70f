"""SGLang's own classes, on the CPU, for the plugin tests.

SGLang's attention test kit (``sglang.test.kits.attention_unittest``, pinned version) builds a
model runner on real pools (``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool``),
a tiny attention module on a real ``RadixAttention`` layer, and a harness around the real
``EagleDraftWorker.draft_forward``. This module adds what the kit lacks for these tests: draft
slots for ``page_size > 1`` with ``topk > 1`` (SGLang's per-branch page layout), a record of
every attention output, the extend batches, and pool snapshots so two backends can run the
same round. Everything runs in float32 on the CPU (Triton kernels under the interpreter).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch

import sglang_stubs
from specattn.integrations.sglang.draft_round import (  # noqa: F401
    draft_positions, eagle_draft_batch)

sglang_stubs.install()

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.speculative.draft_utils import DraftBackendFactory  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import (  # noqa: E402
    dense_attention as dense_kit, mla_attention as mla_kit)
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    speculative_draft_runner as draft_kit)

DTYPE, DEVICE = torch.float32, "cpu"
HIDDEN, VOCAB, MAX_CTX, HEAD_DIM = 32, 50, 64, 16
KV_LORA_RANK, ROPE_DIM = 256, 32  # Lk 288: SGLang's Triton MLA kernel splits it 256 + 32


class _Case:
    """The kit's ``testcase`` argument: only ``skipTest`` is used."""

    def skipTest(self, reason):  # noqa: N802 (unittest's name)
        raise RuntimeError(f"SGLang's kit skipped the fixture: {reason}")


@dataclass(frozen=True)
class Shape:
    model: str = "mha"          # "mha" or "mla"
    num_heads: int = 4          # per rank
    num_kv_heads: int = 2       # per rank (MHA)
    page_size: int = 1
    prefix_lens: tuple = (5, 11, 2)
    tp_size: int = 1            # the attention tensor-parallel size the rank sees
    kv_cache_dtype: str = "auto"  # or "fp8_e4m3" (SGLang's uint8-stored FP8 pool)
    scales: tuple = (1.0, 1.0)  # the layer's (k_scale, v_scale) with an FP8 pool


@dataclass
class Fixture:
    shape: Shape
    runner: object              # the kit's MockModelRunner / MockMLAModelRunner
    module: object              # the attention module (owns one RadixAttention)

    @property
    def layer(self):
        return self.module.attn if self.shape.model == "mha" else self.module.attn_mqa

    def pool_tensors(self) -> list:
        pool = self.runner.token_to_kv_pool
        return list(pool.kv_buffer) if self.shape.model == "mla" else (
            list(pool.k_buffer) + list(pool.v_buffer))

    def snapshot(self) -> list:
        return [t.clone() for t in self.pool_tensors()]

    def restore(self, saved: list) -> None:
        for t, s in zip(self.pool_tensors(), saved):
            t.copy_(s)


@contextlib.contextmanager
def tensor_parallel(tp_size: int):
    """The rank's view of attention tensor parallelism (``attn_tp_size``)."""
    with get_parallel().override(tp_size=tp_size, attn_tp_size=tp_size, moe_tp_size=tp_size,
                                 attn_dcp_rank=0):
        yield


def _model_case(shape: Shape, mode: ForwardMode, extend_lens: tuple = ()):
    common = dict(name=f"specattn_{shape.model}", backend="triton", forward_mode=mode,
                  num_heads=shape.num_heads, page_size=shape.page_size,
                  prefix_lens=shape.prefix_lens, extend_lens=extend_lens)
    if shape.model == "mla":
        return mla_kit.MLAAttentionCase(**common)
    return dense_kit.DenseAttentionCase(num_kv_heads=shape.num_kv_heads, **common)


def build_fixture(shape: Shape, mode: ForwardMode = ForwardMode.DECODE,
                  extend_lens: tuple = (), batch_slots: Optional[int] = None) -> Fixture:
    """Runner + pools + prefix KV (contiguous slots, ``P + b * MAX_CTX + pos``) + module."""
    case = _model_case(shape, mode, extend_lens)
    common = dict(hidden_size=HIDDEN, max_context_len=MAX_CTX, dtype=DTYPE, device=DEVICE,
                  disable_cuda_graph=True, loc_layout="contiguous",
                  runner_batch_size=batch_slots or len(shape.prefix_lens))
    fp8 = shape.kv_cache_dtype == "fp8_e4m3"
    if shape.model == "mla":
        fx = mla_kit.build_mla_attention_fixture(_Case(), case, kv_lora_rank=KV_LORA_RANK,
                                                 qk_rope_head_dim=ROPE_DIM, fp8_kv_cache=fp8,
                                                 **common)
    else:
        fx = dense_kit.build_dense_attention_fixture(_Case(), case, head_dim=HEAD_DIM, **common)
        if fp8:
            _fp8_dense_pool(fx.runner)
    if fp8:
        _set_scales(fx.actual_module.attn if shape.model == "mha"
                    else fx.actual_module.attn_mqa, *shape.scales)
    if shape.tp_size > 1:  # the model's global head counts; the pools hold this rank's share
        config = fx.runner.model_config
        config.num_attention_heads = shape.num_heads * shape.tp_size
        config.num_key_value_heads = shape.num_kv_heads * shape.tp_size
    return Fixture(shape, fx.runner, fx.actual_module)


def _fp8_dense_pool(runner) -> None:
    """The runner's MHA pool replaced by SGLang's FP8 pool (uint8 storage of e4m3) of the
    same shape, the prefix KV the fixture wrote kept (quantized with scale 1, then read
    with the layer's scales: any codes will do)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    old = runner.token_to_kv_pool
    new = MHATokenToKVPool(size=old.size, page_size=old.page_size, dtype=torch.float8_e4m3fn,
                           head_num=old.head_num, head_dim=old.head_dim, layer_num=1,
                           device=DEVICE, enable_memory_saver=False, enable_alt_stream=False)
    for src, dst in ((old.k_buffer, new.k_buffer), (old.v_buffer, new.v_buffer)):
        dst[0].copy_(src[0].to(torch.float8_e4m3fn).view(torch.uint8))
    runner.token_to_kv_pool = new
    runner.kv_cache_dtype, runner.kv_cache_dtype_str = torch.float8_e4m3fn, "fp8_e4m3"


def _set_scales(layer, k_scale: float, v_scale: float) -> None:
    """What SGLang's KV-scale loading leaves on a ``RadixAttention``: one-element tensors and
    their host copies."""
    layer.k_scale, layer.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale


def slot(shape: Shape, b: int, pos: int) -> int:
    return dense_kit._token_loc(b, pos, page_size=shape.page_size, max_context_len=MAX_CTX)


def draft_slots(fx: Fixture, topk: int, steps: int) -> torch.Tensor:
    """Writes the draft slots into ``req_to_token`` and returns ``out_cache_loc``
    ``[B * topk * steps]`` laid out ``(B, topk, steps)``."""
    shape, r2t = fx.shape, fx.runner.req_to_token_pool.req_to_token
    locs = []
    for b, length in enumerate(shape.prefix_lens):
        for lane in draft_positions(length, topk, steps, shape.page_size):
            for pos in lane:
                assert pos < MAX_CTX
                r2t[b, pos] = slot(shape, b, pos)
                locs.append(slot(shape, b, pos))
    return torch.tensor(locs, dtype=torch.int64)


def configure_draft(fx: Fixture, topk: int, steps: int) -> object:
    """Server args and runner fields of an EAGLE draft worker; returns the kit's settings."""
    settings = draft_kit.EagleDraftRunnerSettings(
        topk=topk, speculative_num_steps=steps,
        speculative_num_draft_tokens=steps + 1 if topk == 1 else topk * (steps - 1) + 1,
        capture_batch_size=len(fx.shape.prefix_lens), hidden_size=HIDDEN, vocab_size=VOCAB,
        max_context_len=MAX_CTX, dtype=DTYPE, device=DEVICE, atol=0.0, rtol=0.0)
    draft_kit._configure_runner_for_eagle_draft(fx.runner, _model_case(
        fx.shape, ForwardMode.DECODE), settings)
    return settings


def make_draft_model(fx: Fixture, settings, seed: int = 0):
    """The kit's tiny draft model (embedding, the attention module, LM head), seeded."""
    torch.manual_seed(seed)
    make = (draft_kit._make_mla_model_forward if fx.shape.model == "mla"
            else draft_kit._make_dense_model_forward)
    return make(SimpleNamespace(actual_module=fx.module), settings)


def draft_inputs(fx: Fixture, topk: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    bs = len(fx.shape.prefix_lens)
    return dict(topk_p=torch.softmax(torch.randn(bs, topk, generator=g), -1),
                topk_index=torch.randint(VOCAB, (bs, topk), generator=g),
                hidden_states=torch.randn(bs, HIDDEN, generator=g))


def draft_batch(fx: Fixture, topk: int, out_cache_loc: torch.Tensor, inputs: dict,
                seq_dtype=torch.int32) -> ForwardBatch:
    """The DECODE batch SGLang's ``prepare_for_draft`` hands ``draft_forward``."""
    return eagle_draft_batch(fx.runner, fx.shape.prefix_lens, topk, out_cache_loc, inputs,
                             seq_dtype=seq_dtype)


def create_decode_container(fx: Fixture, topk: int, steps: int):
    """What SGLang's ``EagleDraftWorker.init_attention_backend`` builds (through any hooks)."""
    with tensor_parallel(fx.shape.tp_size):
        return DraftBackendFactory(fx.runner, topk, steps).create_decode_backend()


def create_extend_backend(fx: Fixture, topk: int, steps: int):
    with tensor_parallel(fx.shape.tp_size):
        return DraftBackendFactory(fx.runner, topk, steps).create_draft_extend_backend()


@contextlib.contextmanager
def record_outputs(fx: Fixture):
    """Every output of the fixture's attention layer, in call order."""
    outputs: list = []
    handle = fx.layer.register_forward_hook(lambda m, a, o: outputs.append(o.detach().clone()))
    try:
        yield outputs
    finally:
        handle.remove()


def run_draft(fx: Fixture, container, topk: int, steps: int, settings, model,
              make_batch: Callable[[], ForwardBatch],
              init: Optional[Callable] = None):
    """SGLang's real ``EagleDraftWorker.draft_forward`` over ``container``; returns
    ``(parent_list, top_scores_index, draft_tokens)`` and each step's attention output."""
    worker = draft_kit._EagleDraftWorkerHarness(
        fixture=SimpleNamespace(runner=fx.runner), draft_attn_backend=container,
        model_forward=model, settings=settings)
    fx.runner.draft_attn_backend = container
    batch = make_batch()
    with record_outputs(fx) as outputs:
        if init is None:
            container.init_forward_metadata(batch)
        else:
            init(container, batch)
        batch.mark_forward_metadata_ready()
        parents, scores_index, tokens, _ = worker.draft_forward(batch)
    return (parents, scores_index, tokens), outputs


def extend_batch(fx: Fixture, mode: ForwardMode, extend_lens: tuple) -> ForwardBatch:
    """An extend-family batch over the fixture's prefixes: ``extend_lens[b]`` new tokens at
    positions ``prefix .. prefix + E - 1`` (slots ``slot(b, pos)``), ``seq_lens`` = prefix + E."""
    shape, r2t = fx.shape, fx.runner.req_to_token_pool.req_to_token
    locs, positions = [], []
    for b, (length, ext) in enumerate(zip(shape.prefix_lens, extend_lens)):
        for pos in range(length, length + ext):
            r2t[b, pos] = slot(shape, b, pos)
            locs.append(slot(shape, b, pos))
            positions.append(pos)
    seq = [p + e for p, e in zip(shape.prefix_lens, extend_lens)]
    bs = len(seq)
    fb = ForwardBatch(forward_mode=mode, batch_size=bs,
                      input_ids=torch.zeros(len(locs), dtype=torch.int64),
                      req_pool_indices=torch.arange(bs, dtype=torch.int32),
                      seq_lens=torch.tensor(seq, dtype=torch.int32),
                      seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
                      out_cache_loc=torch.tensor(locs, dtype=torch.int64),
                      seq_lens_sum=sum(seq), positions=torch.tensor(positions))
    fx.runner.kv_index_translator.bind_own_plan(fb)
    if mode != ForwardMode.DECODE:
        fb.extend_prefix_lens = torch.tensor(shape.prefix_lens, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = list(shape.prefix_lens)
        fb.extend_seq_lens = torch.tensor(extend_lens, dtype=torch.int32)
        fb.extend_seq_lens_cpu = list(extend_lens)
        fb.extend_num_tokens = sum(extend_lens)
    return fb


def run_extend(fx: Fixture, backend, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
    """One forward of the fixture's attention module over ``fb`` with ``backend`` active."""
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        backend.init_forward_metadata(fb)
        return fx.module(hidden, fb)


def check_split_rope_call(fx: Fixture, begin: Callable[[], None], call: Callable,
                          q: torch.Tensor, k: torch.Tensor) -> None:
    """DeepSeek's absorbed MLA call with its rope parts apart equals the joined call.

    q: ``[rows, H, KV_LORA_RANK + ROPE_DIM]``, k: ``[rows, 1, KV_LORA_RANK + ROPE_DIM]``;
    ``call(q, k, v, **rope)`` is the backend's forward after ``begin()`` (its metadata
    call): joined as ``(q.flatten(1), k, latent)``, split as the latent parts with
    ``q_rope`` / ``k_rope``. Output and pools must be identical; the pools are restored
    between the two calls."""
    rank = KV_LORA_RANK
    saved = fx.snapshot()
    begin()
    joined = call(q.flatten(1), k, k[..., :rank])
    joined_pools = fx.snapshot()
    fx.restore(saved)
    begin()
    split = call(q[..., :rank], k[..., :rank], k[..., :rank], q_rope=q[..., rank:],
                 k_rope=k[..., rank:])
    assert not torch.isnan(split).any()
    torch.testing.assert_close(split, joined, atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(fx.snapshot(), joined_pools))
