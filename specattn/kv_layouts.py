"""FP8 KV-pool layouts of DeepSeek V3.2 (``dsa``) and V4 (``dsv4``): pack, unpack, read, write.

Pure torch; no device sync. A layout turns one ``D``-wide KV vector per token (``D = d_nope +
d_rope``) into bytes of a ``uint8`` pool ``[num_slots, bytes_per_token]``. Ask for one with
``kv_cache_dtype=`` on the runner (``DraftRunner.mla(..., kv_cache_dtype="fp8_ds_mla")``):
the runner allocates the pool and ``write_kv`` quantizes on write.

The per-tensor FP8 pools (``"fp8_e4m3"``, ``"fp8_e5m2"``) are no byte layout: their pools have
the shapes of bf16 ones (``specattn.fp8``); ``layout_for`` answers ``None`` for them.

``"fp8_ds_mla"`` (DeepSeek V3.2, FlashMLA's ``V32_FP8Sparse``; vLLM's ``fp8_ds_mla``, KsanaLLM's
``kFp8DsMla``; SGLang writes it with ``dsa_kv_cache_store_fp8``). Each token is one contiguous
row (656 bytes for ``kv_lora_rank`` 512 + rope 64)::

    [ d_nope e4m3 | d_nope/128 float32 scales | d_rope bfloat16 ]

Value ``i < d_nope`` is ``e4m3[i] * scale[i // 128]`` (FlashMLA ``flash_mla_interface.py``: "The
first float32 is the scale for the first 128 float8_e4m3 values, ..."); the RoPE part is not
quantized. Here ``scale = amax(|block|) / 448`` in fp32 (FlashMLA's test quantizer also rounds
it up to a power of two; any fp32 scale decodes the same way). Any page size: a token's row
does not depend on its page.

``"fp8_ds_v4"`` (DeepSeek V4, FlashMLA's ``V4_FP8Sparse``; ``tests/quant.py`` of
deepseek-ai/FlashMLA). 584 bytes per token for ``D = 512`` (448 e4m3 + 64 bf16 RoPE + 7 ue8m0
exponents + 1 pad byte), but **page-blocked**: a page of ``P = page_size`` tokens stores ``P``
data rows, then ``P`` scale rows::

    page p:  [ data row 0 | ... | data row P-1 | scale row 0 | ... | scale row P-1 ]
    data row:  [ d_nope e4m3 | d_rope bfloat16 ]          (d_rope = 64)
    scale row: [ d_nope/64 ue8m0 bytes | 1 pad byte ]

so token ``s`` has its data at ``page * P * bpt + (s % P) * (d_nope + 2 d_rope)`` and its scales
at ``page * P * bpt + P * (d_nope + 2 d_rope) + (s % P) * (d_nope/64 + 1)``. An ue8m0 byte
``e`` is the power of two ``2 ** (e - 127)``; the scale of a 64-block is ``amax / 448`` rounded
up to a power of two, floored at 1e-4 (FlashMLA's ``_cast_scale_inv_to_ue8m0``). The pool
row ``s`` of ``[num_slots, bpt]`` is therefore *not* token ``s``'s bytes (the same convention
as FlashMLA's ``k_cache.view(num_blocks, page_block_size, 1, 584)``), and ``num_slots`` must
be a multiple of the page size. FlashMLA's test pads each page to a multiple of 576 bytes;
this pool does not pad (page stride ``P * bpt``).

Both: e4m3 is OCP ``float8_e4m3fn`` (bias 7, no infinities, ``0x7F``/``0xFF`` NaN), encoded with
torch's round-to-nearest-even after clamping to +-448; bf16 and fp32 are little-endian.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import InvalidInputError
from .fp8 import FP8_KV_DTYPES

__all__ = ["KVLayout", "KV_CACHE_DTYPES", "check_kv_cache_dtype", "LAYOUT_NAMES", "FP8_DS_MLA",
           "FP8_DS_V4", "layout_for", "rope_for_width", "e4m3_decode", "E4M3_MAX"]

FP8_DS_MLA = "fp8_ds_mla"
FP8_DS_V4 = "fp8_ds_v4"
LAYOUT_NAMES = (FP8_DS_MLA, FP8_DS_V4)
# Every ``kv_cache_dtype`` specattn knows, the one list that ``SpecConfig``, the runner, the
# backends' ``kv_cache_dtypes`` declarations and ``specattn select --kv-cache-dtype`` accept:
# "auto" (pools in the model's dtype), "fp8_e4m3" / "fp8_e5m2" (FP8 pools with one scale per
# tensor, ``specattn.fp8``) and the DeepSeek byte layouts above.
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES, FP8_DS_MLA, FP8_DS_V4)
E4M3_MAX = 448.0
_V4_ROPE = 64
_UE8M0_FLOOR = 1e-4  # FlashMLA's FP8_AMAX_MARGIN: smallest scale before rounding


@dataclass(frozen=True)
class KVLayout:
    """One FP8 layout bound to a runner's shape (module doc).

    ``fmt``: 1 = ``fp8_ds_mla`` (inline fp32 scales), 2 = ``fp8_ds_v4`` (page-blocked ue8m0)."""

    name: str
    d_nope: int
    d_rope: int
    tile: int
    page_size: int

    @property
    def fmt(self) -> int:
        return 1 if self.name == FP8_DS_MLA else 2

    @property
    def dim(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token: 4 per block (fp32), or 1 per block + 1 pad (ue8m0)."""
        return 4 * self.num_tiles if self.fmt == 1 else self.num_tiles + 1

    @property
    def bytes_per_token(self) -> int:
        return self.d_nope + self.scale_bytes + 2 * self.d_rope

    # --- byte addresses ----------------------------------------------------------------------

    def offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat byte offsets ``(nope, scale, rope)`` ``[n]`` int64 of ``slots [n]``."""
        s = slots.long()
        if self.fmt == 1:
            nope = s * self.bytes_per_token
            return nope, nope + self.d_nope, nope + self.d_nope + self.scale_bytes
        page, within = s // self.page_size, s % self.page_size
        row = self.d_nope + 2 * self.d_rope
        base = page * (self.page_size * self.bytes_per_token)
        nope = base + within * row
        return nope, base + self.page_size * row + within * self.scale_bytes, nope + self.d_nope

    # --- quantization ------------------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: ``[n, D]`` → ``(nope [n, d_nope] uint8 e4m3, scale [n, scale_bytes] uint8,
        rope [n, 2 d_rope] uint8)``: the three byte segments of each token."""
        n = x.shape[0]
        nope = x[:, :self.d_nope].float().reshape(n, self.num_tiles, self.tile)
        amax = nope.abs().amax(-1)
        if self.fmt == 1:
            scale = amax / E4M3_MAX
            scale_bytes = scale.contiguous().view(torch.uint8).reshape(n, -1)
        else:
            exp = torch.ceil(torch.log2((amax / E4M3_MAX).clamp_min(_UE8M0_FLOOR)))
            exp = exp.clamp(-127, 127)
            scale = torch.exp2(exp)
            scale_bytes = torch.zeros(n, self.scale_bytes, dtype=torch.uint8, device=x.device)
            scale_bytes[:, :self.num_tiles] = (exp + 127).to(torch.uint8)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (nope / safe[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
        codes = codes.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, self.d_nope)
        rope = x[:, self.d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return codes, scale_bytes, rope.reshape(n, 2 * self.d_rope)

    def dequantize(self, nope: torch.Tensor, scale: torch.Tensor,
                   rope: torch.Tensor) -> torch.Tensor:
        """The three byte segments ``[n, ...]`` uint8 → values ``[n, D]`` float32."""
        n = nope.shape[0]
        if self.fmt == 1:
            s = scale.contiguous().view(torch.float32).reshape(n, self.num_tiles)
        else:
            s = torch.exp2(scale[:, :self.num_tiles].float() - 127.0)
        vals = e4m3_decode(nope).reshape(n, self.num_tiles, self.tile) * s[..., None]
        r = rope.contiguous().view(torch.bfloat16).float().reshape(n, self.d_rope)
        return torch.cat([vals.reshape(n, self.d_nope), r], 1)

    # --- pool access -------------------------------------------------------------------------

    def _index(self, off: torch.Tensor, width: int) -> torch.Tensor:
        return off[:, None] + torch.arange(width, device=off.device)

    def write(self, pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x [n, D]`` into ``pool [num_slots, bytes_per_token]`` at ``slots [n]``."""
        flat = pool.view(-1)
        slots = slots.reshape(-1).to(pool.device)
        segs = self.quantize(x.reshape(slots.shape[0], self.dim))
        for off, seg in zip(self.offsets(slots), segs):
            flat[self._index(off, seg.shape[1])] = seg

    def read(self, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized values of ``slots [n]``: ``[n, D]`` float32."""
        flat = pool.view(-1)
        nope, scale, rope = self.offsets(slots.reshape(-1).to(pool.device))
        return self.dequantize(flat[self._index(nope, self.d_nope)],
                               flat[self._index(scale, self.scale_bytes)],
                               flat[self._index(rope, 2 * self.d_rope)])

    def read_all(self, pool: torch.Tensor) -> torch.Tensor:
        """Every slot dequantized: ``[num_slots, D]`` float32."""
        return self.read(pool, torch.arange(pool.shape[0], device=pool.device))

    def allocate(self, num_slots: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool ``[num_slots, bytes_per_token]`` uint8 (all values decode to 0)."""
        return torch.zeros(num_slots, self.bytes_per_token, dtype=torch.uint8, device=device)

    def check_pool(self, name: str, pool: torch.Tensor) -> None:
        """``pool`` is a contiguous uint8 ``[num_slots, bytes_per_token]`` tensor (whole pages
        for the page-blocked layout)."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != self.bytes_per_token:
            raise InvalidInputError(
                name, f"a uint8 [num_slots, {self.bytes_per_token}] pool for kv_cache_dtype="
                f"{self.name!r}", f"{str(pool.dtype).replace('torch.', '')} shape "
                f"{tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise InvalidInputError(name, "a contiguous pool (byte offsets are computed)",
                                    f"strides {tuple(pool.stride())}")
        if self.fmt == 2 and pool.shape[0] % self.page_size:
            raise InvalidInputError(name, f"whole pages: num_slots a multiple of page_size="
                                    f"{self.page_size} (the {self.name} layout is page-blocked)",
                                    pool.shape[0])


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes (any shape) → float32."""
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def check_kv_cache_dtype(kv_cache_dtype: object) -> None:
    """``kv_cache_dtype`` is one of ``KV_CACHE_DTYPES``; raises ``InvalidInputError``."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidInputError("kv_cache_dtype", f"one of {list(KV_CACHE_DTYPES)}",
                                repr(kv_cache_dtype))


def layout_for(kv_cache_dtype: str, *, use_mla_backend: bool, kv_lora_rank: Optional[int],
               qk_rope_head_dim: Optional[int], page_size: int) -> Optional[KVLayout]:
    """The layout a runner's ``kv_cache_dtype`` names, bound to its shape; ``None`` for the
    plain dtypes (``"auto"``, ...). Raises ``InvalidInputError`` for a name that is not in
    ``KV_CACHE_DTYPES`` or a shape the layout cannot hold."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype not in LAYOUT_NAMES:
        return None
    if not use_mla_backend:
        raise InvalidInputError("kv_cache_dtype", f"'auto' for an MHA runner ({kv_cache_dtype!r} "
                                "is an MLA latent-pool layout: use DraftRunner.mla)",
                                repr(kv_cache_dtype))
    rank, rope = int(kv_lora_rank or 0), int(qk_rope_head_dim or 0)
    if kv_cache_dtype == FP8_DS_MLA:
        if rank < 128 or rank % 128:
            raise InvalidInputError("kv_lora_rank", "a multiple of 128 for kv_cache_dtype="
                                    "'fp8_ds_mla' (one fp32 scale per 128 values)", rank)
        return KVLayout(FP8_DS_MLA, rank, rope, 128, page_size)
    dim = rank + rope
    nope = dim - _V4_ROPE
    if nope < 64 or nope % 64:
        raise InvalidInputError("kv_lora_rank", "kv_lora_rank + qk_rope_head_dim = 64 + a "
                                "positive multiple of 64 for kv_cache_dtype='fp8_ds_v4' (e4m3 "
                                "blocks of 64, then 64 bf16 RoPE values)", dim)
    return KVLayout(FP8_DS_V4, nope, _V4_ROPE, 64, page_size)


def rope_for_width(kv_cache_dtype: str, kv_lora_rank: int, width: int) -> int:
    """``qk_rope_head_dim`` of a wrapped pool ``[num_slots, width]`` in a layout (inverse of
    ``bytes_per_token``); raises ``InvalidInputError`` when no shape gives ``width``."""
    for rope in range(0, width):
        try:
            lay = layout_for(kv_cache_dtype, use_mla_backend=True, kv_lora_rank=kv_lora_rank,
                             qk_rope_head_dim=rope, page_size=1)
        except InvalidInputError:
            continue
        if lay is None:  # a plain dtype: no layout to size
            break
        if lay.bytes_per_token == width:
            return rope
        if lay.bytes_per_token > width:
            break
    raise InvalidInputError("kv_buffer[0]", f"a width that kv_cache_dtype={kv_cache_dtype!r} "
                            f"gives with kv_lora_rank={kv_lora_rank}", f"width {width}")
