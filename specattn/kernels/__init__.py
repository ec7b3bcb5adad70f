"""Kernel building blocks shared by the backends (vendor modules import from here, never
from each other). Importing this package imports no Triton; its Triton modules do:

- ``tiles``: one key tile of an online softmax (load, scores, update) and the natural-log
  LSE of a finished state;
- ``latent``: latent (MLA) row loads, FP8 pools (``specattn.kv_layouts``) dequantized in
  registers, and one latent key tile in either layout;
- ``merge``: split-KV LSE merges (a stage-2 kernel);
- ``history_merge``: the shared-prefix decode's history pass + merge after a library's
  prefix pass (``flashinfer``, ``flashmla``, ``fa3``/``fa4``);
- ``lse``: the same merge in plain torch, where Triton cannot run;
- ``prefix_slots``: request prefixes as one CSR slot list (``flashinfer``'s ``kv_indices``),
  one launch, no host round trip;
- ``kernel_launch``: a kept compiled Triton kernel launched directly (the CUDA-graph replay
  metadata calls of ``triton`` and ``fa3``/``fa4``);
- ``reference``: the reference backends' plain-torch attention (``attend``) and pool gathers.
"""
