"""The engine-neutral half of the SGLang adapter: SGLang's pools, batches and layers mapped
onto specattn's public API (``DraftRunner``, ``DraftBatch``, ``DraftExtendBatch``,
``AttentionLayer``, a backend's ``forward`` and graph methods).

No SGLang module is imported here: SGLang objects are read by attribute, so this half also
runs with stand-in objects (the GPU test does that). Nothing here does per-step host work:
a round's ``DraftBatch`` is built once (views of SGLang's tensors, no copies) and each
``forward`` only reshapes. SGLang's host copies of the lengths (``seq_lens_cpu``,
``extend_seq_lens_cpu``), where the batch has them, go into the batch's ``seq_lens_cpu`` /
``extend_lens_cpu``, so a backend that plans on the host (``flashinfer``) never reads the
device's lengths back.

FP8 pools (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): SGLang keeps them as ``uint8`` storage of
``pool.dtype``; the runner views the same bytes as that dtype (``kv_cache_dtype`` ``"fp8_e4m3"``
/ ``"fp8_e5m2"``), and each layer's ``k_scale`` / ``v_scale`` (one-element tensors, read on the
device) become the ``AttentionLayer``'s scales (``k_scale_float`` where no tensor is set; 1
where neither is).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from ...errors import CallOrderError, InvalidInputError
from ...fp8 import FP8_KV_DTYPES, dequantize, layer_scales, read_rows

__all__ = ["wrap_pools", "LayerMap", "DecodeAdapter", "ExtendAdapter", "EXTEND_MODES"]

# SGLang forward modes the draft-extend backend serves through specattn (by enum name).
# A decode batch is an extend of one token per request.
EXTEND_MODES = frozenset({"EXTEND", "MIXED", "DRAFT_EXTEND_V2", "DECODE"})


def wrap_pools(model_runner: Any, num_q_heads: int) -> DraftRunner:
    """A ``DraftRunner`` over the model runner's own tensors (no copy).

    Reads ``req_to_token_pool.req_to_token``, ``token_to_kv_pool`` (``k_buffer`` /
    ``v_buffer``, or the MLA ``kv_buffer [slots, 1, kv_lora_rank + rope]`` seen as
    ``[slots, kv_lora_rank + rope]``), ``page_size`` and ``use_mla_backend``; an FP8 pool
    (module doc) with the model's dtype (``model_runner.dtype``).
    ``num_q_heads``: query heads of this rank (tensor parallel split applied)."""
    pool = model_runner.token_to_kv_pool
    store = getattr(pool, "store_dtype", pool.dtype)
    kv_cache_dtype = next((n for n, d in FP8_KV_DTYPES.items() if d == pool.dtype), "auto")
    model_dtype = getattr(model_runner, "dtype", None)
    # ``--kv-cache-dtype bf16`` under an fp16 model gives a pool of another activation dtype,
    # which specattn's backends do not read (the first forward refused the query).
    other_dtype = kv_cache_dtype == "auto" and model_dtype not in (None, pool.dtype)
    if getattr(pool, "is_quantized_kv_cache", False) or other_dtype or store not in (
            pool.dtype, (torch.uint8 if kv_cache_dtype != "auto" else pool.dtype)):
        raise InvalidInputError("model_runner.token_to_kv_pool",
                                "a KV pool of the model dtype, float8_e4m3fn or float8_e5m2 "
                                "(kv_cache_dtype auto, fp8_e4m3, fp8_e5m2)",
                                f"a {type(pool).__name__} of {pool.dtype} stored as {store}"
                                + (f" under a {model_dtype} model" if other_dtype else ""))
    dtype = model_dtype if kv_cache_dtype != "auto" else None
    req_to_token = model_runner.req_to_token_pool.req_to_token
    page_size = int(getattr(model_runner, "page_size", None) or 1)
    if model_runner.use_mla_backend:
        latent = [buf.view(buf.shape[0], -1) for buf in pool.kv_buffer]
        rope = getattr(pool, "qk_rope_head_dim", None)  # (SGLang's MLA pools have it)
        width = int(pool.kv_lora_rank) + int(rope or 0)
        if rope is not None and latent and latent[0].shape[1] != width:  # DSA's packed FP8
            raise InvalidInputError(
                "model_runner.token_to_kv_pool", f"MLA rows of kv_lora_rank + "
                f"qk_rope_head_dim = {width} elements (DeepSeek sparse attention's packed FP8 "
                "pool, --kv-cache-dtype fp8_e4m3 on a DSA model, is not read)",
                f"a {type(pool).__name__} of rows of {latent[0].shape[1]} {pool.dtype} elements")
        return DraftRunner.wrap_mla(req_to_token, latent, num_heads=num_q_heads,
                                    kv_lora_rank=int(pool.kv_lora_rank), page_size=page_size,
                                    kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    return DraftRunner.wrap_mha(req_to_token, pool.k_buffer, pool.v_buffer,
                                num_q_heads=num_q_heads, page_size=page_size,
                                kv_cache_dtype=kv_cache_dtype, dtype=dtype)


def _layer_scale(layer: Any, name: str) -> Any:
    """``layer.k_scale`` (a tensor, used as is), else ``layer.k_scale_float``, else 1."""
    scale = getattr(layer, name, None)
    if scale is None:
        scale = getattr(layer, f"{name}_float", None)
    return 1.0 if scale is None else scale


class LayerMap:
    """SGLang ``RadixAttention`` layers as specattn ``AttentionLayer``s, checked once each.

    ``get(layer)`` returns ``None`` for a call the runner's shape cannot serve: an MLA model's
    layer called in the non-absorbed (MHA) form, whose heads and dims are not the latent
    ones. Features specattn does not implement raise ``InvalidInputError``."""

    def __init__(self, runner: DraftRunner, start_layer: int = 0) -> None:
        self.runner = runner
        self.start_layer = start_layer
        self._layers: dict[tuple, Optional[AttentionLayer]] = {}

    def _expected(self) -> tuple[int, int, int, int]:
        r = self.runner
        if r.use_mla_backend:
            return r.num_heads, 1, r.kv_lora_rank + r.qk_rope_head_dim, r.kv_lora_rank
        return r.num_q_heads, r.num_kv_heads, r.head_dim, r.v_head_dim

    def get(self, layer: Any) -> Optional[AttentionLayer]:
        # The scale objects are part of the key: a layer whose scale tensor is replaced
        # (weights reloaded) is converted again.
        key = (layer.layer_id, layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
               layer.v_head_dim, id(_layer_scale(layer, "k_scale")),
               id(_layer_scale(layer, "v_scale")))
        if key not in self._layers:
            self._layers[key] = self._convert(layer, key[1:5])
        return self._layers[key]

    def require(self, layer: Any) -> AttentionLayer:
        """Like ``get``, but a shape the runner cannot serve is an error."""
        converted = self.get(layer)
        if converted is None:
            h, kv, d, dv = self._expected()
            raise InvalidInputError(
                "layer (tp_q_head_num, tp_k_head_num, qk_head_dim, v_head_dim)",
                f"({h}, {kv}, {d}, {dv}), the draft pool's per-rank shape",
                (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                 layer.v_head_dim))
        return converted

    def _convert(self, layer: Any, shape: tuple) -> Optional[AttentionLayer]:
        window = getattr(layer, "sliding_window_size", -1)
        if window is not None and window > -1:
            raise InvalidInputError("layer.sliding_window_size", "-1: specattn serves full "
                                    "attention", window)
        if getattr(layer, "is_cross_attention", False):
            raise InvalidInputError("layer.is_cross_attention", "False", True)
        cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
        method = getattr(layer, "logit_capping_method", "tanh")
        if cap > 0 and method != "tanh":
            raise InvalidInputError("layer.logit_capping_method", "'tanh'", repr(method))
        if tuple(shape) != self._expected():
            return None
        local_id = layer.layer_id - self.start_layer
        if not 0 <= local_id < self.runner.num_layers:
            raise InvalidInputError("layer.layer_id", f"in [{self.start_layer}, "
                                    f"{self.start_layer + self.runner.num_layers}) (the "
                                    "pool's layers)", layer.layer_id)
        return AttentionLayer(local_id, scaling=float(layer.scaling), logit_cap=cap,
                              k_scale=_layer_scale(layer, "k_scale"),
                              v_scale=_layer_scale(layer, "v_scale"))


def _host_copy(values: Any, like: torch.Tensor) -> Optional[torch.Tensor]:
    """SGLang's host copy of a ``[B]`` length tensor ``like`` (a CPU tensor or a list of
    ints), or ``None`` where the batch has none of that length (then the backend copies
    ``like`` itself)."""
    if isinstance(values, (list, tuple)):
        if len(values) != like.shape[0]:
            return None
        return torch.tensor(values, dtype=torch.int64)
    if (isinstance(values, torch.Tensor) and values.device.type == "cpu"
            and tuple(values.shape) == tuple(like.shape)):
        return values
    return None


class _Adapter:
    """What decode and extend share: the runner, the layers and the new-KV arguments."""

    def __init__(self, backend: Any, start_layer: int = 0) -> None:
        self.backend = backend
        self.runner: DraftRunner = backend.runner
        self.layers = LayerMap(self.runner, start_layer)

    def _new_kv(self, layer: AttentionLayer, rows: int, k: Optional[torch.Tensor],
                v: Optional[torch.Tensor], save_kv_cache: bool, slots: torch.Tensor,
                k_rope: Optional[torch.Tensor]):
        """The ``k, v`` specattn's ``forward`` writes. When the model stored the KV itself
        (``save_kv_cache=False`` or ``k is None``), the stored rows are handed back, so the
        write leaves the pool as it is (FP8 rows dequantized: quantizing them again gives
        the same codes)."""
        r = self.runner
        if k is None or not save_kv_cache:
            slots = slots.reshape(-1).long()
            pools = r.layer_pools(layer.layer_id)
            if r.fp8:
                stored = [dequantize(read_rows(pool, slots), scale, r.dtype) for pool, scale
                          in zip(pools, layer_scales(layer, r.use_mla_backend))]
            else:
                stored = [pool[slots] for pool in pools]
            return stored[0], stored[1] if len(stored) > 1 else None
        if r.use_mla_backend:
            latent = k.reshape(rows, -1)
            if k_rope is not None:
                latent = torch.cat([latent, k_rope.reshape(rows, -1)], dim=-1)
            return latent, None
        return (k.reshape(rows, r.num_kv_heads, r.head_dim),
                v.reshape(rows, r.num_kv_heads, r.v_head_dim))

    def _batch_of(self, forward_batch: Any):
        """The specattn batch of ``forward_batch`` (views of its tensors)."""
        raise NotImplementedError

    def begin(self, forward_batch: Any) -> None:
        """Eager: prepare the batch (every step of a draft round)."""
        self.batch = self._batch_of(forward_batch)
        self.backend.init_forward_metadata(self.batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def capture(self, forward_batch: Any) -> None:
        """Before a CUDA-graph capture (outside the graph)."""
        self.batch = self._batch_of(forward_batch)
        self.backend.init_forward_metadata_capture_cuda_graph(self.batch)

    def replay(self, forward_batch: Any) -> None:
        """Before a replay: ``forward_batch`` holds the graph's (padded) batch size."""
        self.batch = self._batch_of(forward_batch)
        self.backend.init_forward_metadata_replay_cuda_graph(self.batch,
                                                             int(forward_batch.batch_size))

    def _require_batch(self) -> None:
        if self.batch is None:
            raise CallOrderError("init_forward_metadata", "a call before forward",
                                 f"{type(self).__name__}.forward first")

    def _attend(self, call, slots: torch.Tensor, q: torch.Tensor, k: Optional[torch.Tensor],
                v: Optional[torch.Tensor], layer: Any, save_kv_cache: bool,
                k_rope: Optional[torch.Tensor],
                q_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``call(layer, q, k, v)`` in specattn's shapes; ``o`` back as ``[rows, H * D_v]``."""
        spec_layer = self.layers.require(layer)
        rows = q.shape[0]
        k, v = self._new_kv(spec_layer, rows, k, v, save_kv_cache, slots, k_rope)
        return call(spec_layer, self._query(q, q_rope), k, v).reshape(rows, -1)

    def _query(self, q: torch.Tensor, q_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q`` as ``[rows, H, D]``; an MLA query given as its latent part ``q [rows, H *
        kv_lora_rank]`` and ``q_rope [rows, H * rope]`` (DeepSeek's absorbed attention under
        the FA3 / FlashInfer / TRT-LLM names) joined."""
        r = self.runner
        rows = q.shape[0]
        if q_rope is not None and not r.use_mla_backend:
            raise InvalidInputError("q_rope", "None for an MHA pool (a rope part is MLA's)",
                                    tuple(q_rope.shape))
        if q_rope is not None:
            return torch.cat([q.reshape(rows, r.num_heads, r.kv_lora_rank),
                              q_rope.reshape(rows, r.num_heads, r.qk_rope_head_dim)], dim=-1)
        if r.use_mla_backend:
            return q.reshape(rows, r.num_heads, r.kv_lora_rank + r.qk_rope_head_dim)
        return q.reshape(rows, r.num_q_heads, r.head_dim)


class DecodeAdapter(_Adapter):
    """One draft round of SGLang's multi-step decode on a specattn ``DraftDecodeBackend``.

    ``parents``: ``[S, max_bs, K]`` lanes for ``path`` tree mode, filled in place by the
    caller before each step (``None`` in ``lane`` mode)."""

    def __init__(self, backend: Any, start_layer: int = 0) -> None:
        super().__init__(backend, start_layer)
        self.topk = backend.topk
        self.num_steps = backend.num_steps
        self.parents: Optional[torch.Tensor] = None
        self.batch: Optional[DraftBatch] = None

    def draft_batch(self, forward_batch: Any) -> DraftBatch:
        """``forward_batch`` (``req_pool_indices [B]``, ``seq_lens [B]`` = committed
        prefix, ``out_cache_loc [B * K * S]`` laid out ``(B, K, S)``) as a ``DraftBatch``."""
        bs = int(forward_batch.batch_size)
        loc = forward_batch.out_cache_loc
        want = bs * self.topk * self.num_steps
        if loc is None or loc.numel() != want:
            raise InvalidInputError("forward_batch.out_cache_loc",
                                    f"{want} slots (batch {bs} x topk {self.topk} x steps "
                                    f"{self.num_steps})", None if loc is None else loc.numel())
        parents = None
        if self.backend.tree_mode == "path":
            parents = self._parents_for(bs, loc.device)
        seq_lens = forward_batch.seq_lens
        return DraftBatch(forward_batch.req_pool_indices, seq_lens,
                          loc.reshape(bs, self.topk, self.num_steps), parents,
                          _host_copy(getattr(forward_batch, "seq_lens_cpu", None), seq_lens))

    def _parents_for(self, bs: int, device: torch.device) -> torch.Tensor:
        if self.parents is None or self.parents.shape[1] < bs:
            self.parents = torch.zeros(self.num_steps, bs, self.topk, dtype=torch.int64,
                                       device=device)
        return self.parents[:, :bs]

    def record_parents(self, step: int, parent_lanes: torch.Tensor) -> None:
        """``parent_lanes [B, K]``: the step ``step - 1`` lane each step-``step`` token
        descends from (``path`` mode; in place, so a captured graph records it too)."""
        if self.parents is not None and step >= 1:
            self.parents[step, :parent_lanes.shape[0]].copy_(parent_lanes)

    _batch_of = draft_batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        if self.backend.tree_mode == "path":  # fixed, so the graph's parents stay put
            device = self.runner.req_to_token.device
            self.parents = torch.zeros(self.num_steps, max_bs, self.topk, dtype=torch.int64,
                                       device=device)

    def forward(self, step: int, q: torch.Tensor, k: Optional[torch.Tensor],
                v: Optional[torch.Tensor], layer: Any, save_kv_cache: bool = True,
                k_rope: Optional[torch.Tensor] = None,
                q_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Step ``step`` of one layer: ``q [B*K, H_q * D]`` (or ``[B*K, H_q, D]``; MLA: or
        the latent part with ``q_rope`` apart) → ``o [B*K, H_q * D_v]``, as SGLang's
        backends return it."""
        self._require_batch()
        return self._attend(lambda *args: self.backend.forward(step, *args),
                            self.batch.out_cache_loc[:, :, step], q, k, v, layer,
                            save_kv_cache, k_rope, q_rope)


class ExtendAdapter(_Adapter):
    """SGLang's draft extend (and the draft runner's own extend/decode batches) on a specattn
    ``DraftExtendBackend``."""

    def __init__(self, backend: Any, start_layer: int = 0) -> None:
        super().__init__(backend, start_layer)
        self.batch: Optional[DraftExtendBatch] = None

    @staticmethod
    def serves_mode(forward_batch: Any) -> bool:
        return forward_batch.forward_mode.name in EXTEND_MODES

    def extend_batch(self, forward_batch: Any) -> DraftExtendBatch:
        """``seq_lens [B]`` (prefix + new tokens), ``extend_seq_lens [B]`` (one per request
        in a decode batch) and ``out_cache_loc [sum(E)]`` as a ``DraftExtendBatch``."""
        seq_lens = forward_batch.seq_lens
        if forward_batch.forward_mode.name == "DECODE":
            extend_lens = torch.ones_like(seq_lens)
            ext_host = torch.ones(seq_lens.shape, dtype=torch.int64)
        else:
            extend_lens = forward_batch.extend_seq_lens
            if extend_lens is None:
                raise InvalidInputError("forward_batch.extend_seq_lens",
                                        "a [batch] tensor of new tokens per request", None)
            ext_host = _host_copy(getattr(forward_batch, "extend_seq_lens_cpu", None),
                                  extend_lens)
        return DraftExtendBatch(forward_batch.req_pool_indices, seq_lens, extend_lens,
                                forward_batch.out_cache_loc,
                                _host_copy(getattr(forward_batch, "seq_lens_cpu", None),
                                           seq_lens), ext_host)

    _batch_of = extend_batch

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: Any, save_kv_cache: bool = True,
                k_rope: Optional[torch.Tensor] = None,
                q_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q [T, H_q * D]`` (MLA: or the latent part with ``q_rope`` apart) → ``o [T,
        H_q * D_v]`` (``T = sum(extend_seq_lens)``)."""
        self._require_batch()
        return self._attend(self.backend.forward, self.batch.out_cache_loc, q, k, v, layer,
                            save_kv_cache, k_rope, q_rope)
