"""Stand-in for ``flash_attn.cute`` (flash-attn-4 4.0.0b36): ``flash_attn_varlen_func``.

Same signature as the documented interface, so an unknown keyword fails like the real one.
Paged use: ``cu_seqlens_k`` must be None, key counts in ``seqused_k``; returns
``(out, lse or None)``, LSE ``(H_q, total_q)`` natural log (``-inf`` for a row with no keys).
"""

from __future__ import annotations

from .fa_reference import Recorder, StandInError, check_and_attend

RECORDER = Recorder()


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
                           softmax_scale=None, causal=False, window_size=(None, None),
                           learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, mask_mod=None,
                           block_sparse_tensors=None, cu_total_m_blocks=None,
                           cu_total_n_blocks=None, aux_tensors=None, return_lse=False):
    if page_table is None or cu_seqlens_k is not None:
        raise StandInError("paged use: page_table given and cu_seqlens_k None (FA4 rule)")
    if seqused_q is not None or window_size != (None, None) or num_splits != 1:
        raise StandInError("the glue sets no seqused_q / window / num_splits")
    if softmax_scale is None:
        raise StandInError("the glue passes softmax_scale explicitly")
    out, lse = check_and_attend("fa4", RECORDER, q, k, v, page_table=page_table,
                                seqused=seqused_k, cu_seqlens_q=cu_seqlens_q,
                                max_seqlen_q=max_seqlen_q, scale=softmax_scale, causal=causal,
                                softcap=softcap, with_lse=return_lse,
                                empty_lse=float("-inf"), empty_out=0.0)
    return out, (lse if return_lse else None)
