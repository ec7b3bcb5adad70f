"""The FA3-style ``flash_attn_with_kvcache`` stand-in, shared by ``fa_interface`` (FA3's
``flash_attn_interface``) and ``fa_mate`` (the MUSA port, same API).

Same signature as FA3's documented function. Paged varlen use: ``page_table`` plus
``cache_seqlens``, ``cu_seqlens_q`` with ``max_seqlen_q``; no new k/v, rotary, descales.
Returns ``out``, or ``(out, softmax_lse)`` with LSE ``(H_q, total_q)`` natural log. A row
with no keys gets LSE ``+inf`` and a NaN output (FA2/FA3's convention for the LSE; the NaN
makes sure the glue gives such a row no weight).
"""

from __future__ import annotations

from .fa_reference import Recorder, StandInError, check_and_attend


def make_flash_attn_with_kvcache(api: str, recorder: Recorder):
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                                cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None,
                                sm_margin=0, return_softmax_lse=False):
        extras = (k, v, qv, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                  cu_seqlens_k_new, rotary_seqlens, q_descale, k_descale, v_descale)
        if any(x is not None for x in extras):
            raise StandInError("the glue appends no KV and uses no rotary / descale / qv")
        if page_table is None or cache_seqlens is None or cu_seqlens_q is None:
            raise StandInError("paged varlen use: page_table, cache_seqlens, cu_seqlens_q")
        if max_seqlen_q is None:
            raise StandInError("max_seqlen_q is required with cu_seqlens_q")
        if softmax_scale is None or window_size != (-1, -1):
            raise StandInError("softmax_scale explicit, no window")
        out, lse = check_and_attend(api, recorder, q, k_cache, v_cache, page_table=page_table,
                                    seqused=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                                    max_seqlen_q=max_seqlen_q, scale=softmax_scale,
                                    causal=causal, softcap=softcap,
                                    with_lse=return_softmax_lse, empty_lse=float("inf"),
                                    empty_out=float("nan"))
        return (out, lse) if return_softmax_lse else out

    return flash_attn_with_kvcache
