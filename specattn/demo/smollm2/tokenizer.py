"""SmolLM2's tokenizer rebuilt from the GGUF: byte-level BPE over its tokens and merges.

``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with ``tokenizer.ggml.pre == "smollm"``:
digits are split one by one, then GPT-2's byte-level regex applies (no prefix space). The
control tokens (``token_type == 3``: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...)
become special tokens, so they encode as one id and are never split.
"""

from __future__ import annotations

from dataclasses import dataclass

from .weights import MODEL_READERS_HINT, ModelMissingError, field_value

__all__ = ["SmolTokenizer", "build_tokenizer", "CONTROL"]

CONTROL = 3  # llama.cpp's token type of control tokens
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise ModelMissingError("rebuilding the tokenizer needs the 'tokenizers' package: "
                                f"{MODEL_READERS_HINT}") from exc
    return tokenizers


@dataclass
class SmolTokenizer:
    """A ``tokenizers.Tokenizer`` plus the GGUF's special ids.

    specials: control token text -> id, as listed in the GGUF.
    """

    tokenizer: object
    bos_id: int
    eos_id: int
    unk_id: int
    specials: dict[str, int]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def chat(self, user: str, system: str = DEFAULT_SYSTEM) -> str:
        """The GGUF's chat template for one user turn, ending with the assistant's header."""
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def build_tokenizer(reader) -> SmolTokenizer:
    """Rebuild the tokenizer from a ``gguf.GGUFReader``'s ``tokenizer.ggml.*`` fields."""
    tk = _tokenizers()
    model = field_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelMissingError(f"expected a byte-level BPE ('gpt2') tokenizer, got {model!r}")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    tok = tk.Tokenizer(bpe)
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = tk.decoders.ByteLevel()
    specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t in specials])
    return SmolTokenizer(tok, int(field_value(reader, "tokenizer.ggml.bos_token_id")),
                         int(field_value(reader, "tokenizer.ggml.eos_token_id")),
                         int(field_value(reader, "tokenizer.ggml.unknown_token_id")), specials)
