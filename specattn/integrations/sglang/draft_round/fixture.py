"""The round's case and its fixture: SGLang's attention-kit runner, pools and attention module
for one model, batch and page size, with long prefixes written straight into the pools."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ....errors import BackendUnavailableError, InvalidInputError
from .. import stubs


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
        return eagle_draft_batch(self.runner, self.lengths, self.case.topk, self.loc, inputs,
                                 device=self.device)


def eagle_draft_batch(runner, lengths, topk: int, out_cache_loc: torch.Tensor, inputs: dict,
                      *, device: str = "cpu", seq_dtype: torch.dtype = torch.int32):
    """The DECODE ``ForwardBatch`` SGLang's ``prepare_for_draft`` hands ``draft_forward``:
    requests ``0 .. B-1`` of ``lengths`` (a host copy of them too), ``topk`` lanes each, a
    copy of ``out_cache_loc`` and of ``inputs``' ``topk_p`` / ``topk_index`` /
    ``hidden_states``; bound to ``runner``'s KV index translator."""
    from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode,
                                                              ForwardBatch, ForwardMode)
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec = EagleDraftInput(topk_p=inputs["topk_p"].clone(),
                           topk_index=inputs["topk_index"].clone(),
                           hidden_states=inputs["hidden_states"].clone(),
                           capture_hidden_mode=CaptureHiddenMode.LAST,
                           num_tokens_per_req=topk, num_tokens_for_logprob_per_req=topk)
    seq = torch.tensor(lengths, dtype=seq_dtype, device=device)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(lengths), input_ids=None,
        req_pool_indices=torch.arange(len(lengths), dtype=torch.int32, device=device),
        seq_lens=seq, seq_lens_cpu=seq.to("cpu", copy=True),
        out_cache_loc=out_cache_loc.clone(), seq_lens_sum=sum(lengths),
        positions=seq.repeat_interleave(topk).long(), spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=spec, capture_hidden_mode=CaptureHiddenMode.LAST)
    runner.kv_index_translator.bind_own_plan(fb)
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
