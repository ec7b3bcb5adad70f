"""FlashAttention backends: ``fa3`` and ``fa4`` (one family; a MUSA flavour on MUSA). No FP8 KV
pools: FlashAttention-4 4.0.0b36 runs FP8 K/V on SM100 only and with the query in FP8 too,
FlashAttention-3's FP8 kernel also wants the query in FP8 (``backend._FP8_REFUSALS``).

- ``fa4`` (CUDA sm9x/sm10x): FlashAttention-4, ``flash_attn.cute.flash_attn_varlen_func``
  with ``page_table`` and ``seqused_k``.
- ``fa3`` (CUDA sm8x, sm90): FlashAttention-3, ``flash_attn_interface.flash_attn_with_kvcache``
  when installed. On a Hopper GPU without it but with FlashAttention-4, ``fa3`` runs FA4's
  sm90 kernel (the same algorithm), says so in ``specattn list`` and logs it once.
  **The FA3 path is untested on hardware** (no FA3 wheel for our H200's PyTorch).
- MUSA: both names use the MUSA port of the FA3-style API (``mate.flash_attn_with_kvcache``);
  **untested on hardware**.

Draft decode reads each request's prefix once for all ``K`` lanes (FA prefix pass, then one
Triton kernel for the per-lane history and the natural-log LSE merge); ``K == 1`` is one
pass; ``mode="per-branch"`` is upstream's one-sequence-per-lane design; ``split_prefix=C``
splits each prefix into ``C`` chunks; the default ``mode="auto"`` picks among these per round
from the batch shape and SM count (``_route.py``). Draft extend is one causal
varlen pass, or where one request's pass would leave SMs idle (by default from the same
model; ``split_prefix=C`` fixes it) ``C`` prefix chunks plus a causal tail merged by LSE
(``_extend.py``). Any page size: prefixes use page ids (``[num_pages, P, H_kv, D]`` view of the
pool), histories a page-size-1 view.

Layout: ``backend.py`` (the registered classes), ``_decode.py`` / ``_extend.py`` (the glue),
``_library.py`` (the libraries' entry points), ``_route.py`` (``auto`` routing), ``_tables.py``
(pool views, page-table checks), ``_metadata.py`` (a round's tables in one Triton launch,
which also fills a CUDA graph's fixed buffers; a graph replay's metadata call launches the
kept compiled kernel).

Status: the glue is tested on the CPU against ``torch_ref`` through stand-ins of the three
libraries that follow their documented APIs (``tests/test_flash_attn.py``). On the H200
(2026-11-29, flash-attn-4 4.0.0b36) ``tests/gpu/test_flash_attn_gpu.py`` passed against
``torch_ref`` with the real FA4 kernel: decode (topk 1/4/8, page 1/16/64, lane/path,
shared/per-branch/split-prefix/auto, Triton history+merge and the torch-merge fallback),
random shapes, extend, ``fa3`` through FA4's sm90 kernel, and CUDA-graph capture/replay
(H200, 2026-11-29: gqa-long 1.42x the floor, 5.9x faster than FA4 per-branch); on
2026-12-03 also the split extend (forced chunks, one request of 32k keys on the auto route,
a graph replay) and the conformance kit with ``split_prefix=3``. The
FA3 library path (sm8x, or sm90 with ``flash_attn_interface``) and MUSA are untested on
hardware.

MHA/GQA only: FA4 accepts the absorbed MLA shape (576/512) only on SM100/110, not on the
H200; FA3's MLA path (``qv``) is not wired yet.
"""

from __future__ import annotations

from .backend import (MODES, FA3DecodeMUSA, FA3DecodeSM8x, FA3DecodeSM90, FA3ExtendMUSA,
                      FA3ExtendSM8x, FA3ExtendSM90, FA4Decode, FA4DecodeMUSA, FA4Extend,
                      FA4ExtendMUSA)

__all__ = ["FA3DecodeSM8x", "FA3DecodeSM90", "FA3DecodeMUSA", "FA4Decode", "FA4DecodeMUSA",
           "FA3ExtendSM8x", "FA3ExtendSM90", "FA3ExtendMUSA", "FA4Extend", "FA4ExtendMUSA",
           "MODES"]
