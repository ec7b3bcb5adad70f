"""FlashInfer backends (``flashinfer``, MHA and MLA flavours), FlashInfer 0.7.x.

Draft decode reads each request's prefix once for all ``K`` lanes: a prefix pass (paged
prefill wrapper, ``K`` non-causal query rows per request) plus one small Triton kernel that
attends each lane to its history and merges with the prefix result by the prefix's base-2
LSE (Triton ships with torch on CUDA). ``topk == 1`` is one plain decode over prefix +
history. MLA does the same with ``BatchMLAPagedAttentionWrapper`` for the prefix pass, so
``topk > 1`` works for MLA too. FP8 KV pools (``fp8_e4m3`` / ``fp8_e5m2`` for MHA, ``fp8_e4m3`` on
SM90 with a bf16 query, rank 512 and rope 0/64 for MLA: FlashInfer 0.7.4's FP8 kernels) run
with the layer's scales as FlashInfer's arguments when they are Python floats, folded into the
query and the output when they are device tensors.
Draft extend is one causal paged prefill (MHA) or MLA pass over ragged requests.

The token pool ``[num_slots, H_kv, D]`` (MLA ``[num_slots, R + rope]``) is viewed as pages
of one token, so FlashInfer indices are token slots and any engine page size works (also
page size > 1 with ``topk > 1``). Layout of this package:

- ``_slots.py``: the host CSR FlashInfer plans from, pure-torch CSR slot lists (device-built,
  no host sync);
- ``specattn.kernels.prefix_slots``: the prefix slot list in one launch (Triton);
- ``_passes.py``: one planned FlashInfer call (the only vendor imports);
- ``_replan.py``: a graph wrapper's later plans as direct replans (the public ``plan`` costs
  far more host time): FlashInfer's native planner, or none where the slot-list launch
  writes the schedule;
- ``_prefill_plan.py`` / ``_mla_plan.py``: where the slot-list launch writes a prefill (FA2)
  or MLA graph wrapper's schedule, in place of FlashInfer's host planners
  (``specattn.kernels.prefill_schedule`` / ``mla_schedule``: the device functions);
- ``specattn.kernels.history_merge``: the fused history pass + merge (Triton, shared with
  ``flashmla`` and ``fa4``);
- ``_decode.py`` / ``_extend.py``: the plan/run protocol shared by both flavours;
- ``backend.py``: the four registered classes.

Limits: FlashInfer plans the softmax scale and the soft cap, so a layer with other values
than the last plan triggers a re-plan (eager; refused under graph capture, and after an
extend graph replay, which plans without host lengths). MLA has no soft cap. CUDA graph
replay (decode and extend) re-plans before each replay with one kept launch: the slot list,
the CSR and, where the capture's plan has the layout FlashInfer 0.7.4 gives it, FlashInfer's
schedule (FA2 prefill or MLA) written on the device, so no planner runs on the host. Other
layouts (another FlashInfer release, fa3, a fixed split size), and the decode passes planned
per step (one lane, or the ``per-branch`` mode), call FlashInfer's native planner (host
code). A decode replay reads the
lengths' host copies the batch carries (``DraftBatch.seq_lens_cpu``; without them one copy
of the lengths per round, which waits for the device); an extend replay with a device
schedule reads none. MHA values must be at least 64 wide (``v_head_dim``): FlashInfer's
prefill kernels have no tile for narrower ones, so the classes refuse such a runner.
"""

from __future__ import annotations

from .backend import (MODES, FlashInferDecode, FlashInferExtend, FlashInferMLADecode,
                      FlashInferMLAExtend)

__all__ = ["FlashInferDecode", "FlashInferMLADecode", "FlashInferExtend",
           "FlashInferMLAExtend", "MODES"]
