"""``specattn demo``: EAGLE draft rounds on a tiny random model, end to end, on this machine."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional, TextIO

import torch

from .._argparse import CommandParser
from ..data import DraftRunner
from ..errors import SpecAttnError
from ..selection import describe_error
from ..platforms import Platform, current_platform, torch_device_type, use_platform
from ._args import non_negative, positive
from ._backends import select_backends
from .eagle import EagleDrafter, ErrorMeter
from .model import DraftModel, ModelConfig
from .render import LEGEND, lane_divergence, render_meter, render_tree, slow_start_note

__all__ = ["build_parser", "cli_main", "run_demo"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODELS = ("synthetic", "smollm2")


def build_parser() -> argparse.ArgumentParser:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = CommandParser(
        prog="specattn demo",
        description="Run EAGLE draft rounds (draft extend, then multi-step top-k draft "
                    "decode) of a tiny random-weight draft model through the backend "
                    "specattn selects, and check its outputs against torch_ref.")
    p.add_argument("--backend", default="auto",
                   help="attention backend name, or 'auto' (default) to let specattn choose")
    p.add_argument("--batch", type=positive, default=4, help="requests (default 4)")
    p.add_argument("--min-len", type=positive, default=16, help="shortest prompt (16)")
    p.add_argument("--max-len", type=positive, default=64, help="longest prompt (64)")
    p.add_argument("--topk", type=positive, default=4, help="branches per request (4)")
    p.add_argument("--steps", type=positive, default=4, help="draft depth S (4)")
    p.add_argument("--page-size", type=positive, default=16, help="KV page size (16)")
    p.add_argument("--tree-mode", choices=("lane", "path"), default="lane",
                   help="lane: upstream lane histories (default); path: exact EAGLE ancestry")
    p.add_argument("--mla", action="store_true", help="MLA draft model (absorbed queries)")
    p.add_argument("--rounds", type=positive, default=3, help="draft rounds (3)")
    p.add_argument("--layers", type=positive, default=2, help="transformer layers (2)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="activation and KV dtype (bf16)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                   help=f"device (default here: {default_device})")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, prompts, acceptance")
    p.add_argument("--trees", type=non_negative, default=2,
                   help="requests whose draft tree is printed each round (2)")
    p.add_argument("--no-check", action="store_true",
                   help="skip recomputing every attention call with torch_ref")
    p.add_argument("--explain", action="store_true",
                   help="print every step of the backend selection (rule numbers: "
                        "docs/selection.md)")
    p.add_argument("--model", choices=MODELS, default="synthetic",
                   help="synthetic: this random draft model (default); smollm2: "
                        "self-speculative decoding of SmolLM2-135M (see --model smollm2 "
                        "--help)")
    return p


def _model_choice(argv: list[str]) -> tuple[str, list[str]]:
    """``--model NAME`` (or ``--model=NAME``) and the other arguments."""
    pre = CommandParser(prog="specattn demo", add_help=False)
    pre.add_argument("--model", choices=MODELS, default="synthetic")
    known, _ = pre.parse_known_args(argv)
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--model":
            skip = True
        elif not arg.startswith("--model="):
            rest.append(arg)
    return known.model, rest


def _model_config(args: argparse.Namespace) -> ModelConfig:
    if args.mla:
        return ModelConfig(num_layers=args.layers, mla=True, hidden=256, num_heads=4,
                           kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
                           v_head_dim=64)
    return ModelConfig(num_layers=args.layers, hidden=256, num_q_heads=4, num_kv_heads=2,
                       head_dim=64)


def _make_runner(cfg: ModelConfig, args: argparse.Namespace, dtype: torch.dtype) -> DraftRunner:
    """Pools sized for every prompt, all rounds' accepted tokens and one round of drafts
    (with ``P > 1`` and ``K > 1`` each branch gets its own pages: upstream layout)."""
    p, k, s = args.page_size, args.topk, args.steps
    draft_room = k * (math.ceil((p - 1 + s) / p) + 1) * p
    max_ctx = args.max_len + args.rounds * (s + 1) + draft_room
    pages_per_req = math.ceil(max_ctx / p) + 1
    num_slots = (args.batch * pages_per_req + 2) * p
    common = dict(num_layers=cfg.num_layers, num_slots=num_slots, max_reqs=args.batch + 1,
                  max_context_len=max_ctx, page_size=p, dtype=dtype, device=args.device)
    if cfg.mla:
        return DraftRunner.mla(cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, **common)
    return DraftRunner.mha(cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, **common)


def _prompt_lens(batch: int, lo: int, hi: int) -> list[int]:
    """Evenly spread from ``lo`` to ``hi``: ragged unless ``lo == hi``."""
    if batch == 1:
        return [hi]
    return [lo + round(b * (hi - lo) / (batch - 1)) for b in range(batch)]


def run_demo(args: argparse.Namespace, out: TextIO, started: Optional[float] = None) -> int:
    """The demo proper; returns 0 when every output matched torch_ref, else 1.

    Selection is made for the platform of ``--device``: on a GPU machine, ``--device cpu``
    selects among the CPU backends. ``started``: the ``time.perf_counter()`` the printed
    total counts from (the command passes the process's start; default: now)."""
    started = time.perf_counter() if started is None else started
    detected = current_platform()
    if torch_device_type(detected) == args.device:
        return _run(args, out, started)
    cpu = Platform("cpu", None, detected.cpu_has_amx, triton_interpret=detected.triton_interpret)
    with use_platform(cpu):
        return _run(args, out, started)


def _run(args: argparse.Namespace, out: TextIO, started: float) -> int:
    from ..allocator import PagedKVAllocator

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)  # flushed: a slow round shows what came before

    t0 = time.perf_counter()
    dtype = DTYPES[args.dtype]
    cfg = _model_config(args)
    model = DraftModel(cfg, seed=args.seed, dtype=dtype, device=args.device)
    runner = _make_runner(cfg, args, dtype)
    say(f"platform: {current_platform()}")
    say(f"model: {'MLA' if cfg.mla else 'GQA'} draft model, {cfg.num_layers} layers, hidden "
        f"{cfg.hidden}, vocab {cfg.vocab_size}, random weights (seed {args.seed})")
    say(f"runner: {runner}")
    lens = _prompt_lens(args.batch, args.min_len, args.max_len)
    say(f"requests: {args.batch}, prompt lengths {lens}; topk {args.topk}, steps "
        f"{args.steps}, tree mode {args.tree_mode}")
    say()

    extend, decode = select_backends(args, runner, say)
    names = {"extend": type(extend).name,
             "decode": None if decode is None else type(decode).name}
    say()

    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    meter = None if args.no_check else ErrorMeter(dtype)
    drafter = EagleDrafter(model, runner, PagedKVAllocator(runner), extend, decode,
                           topk=args.topk, num_steps=args.steps, tree_mode=args.tree_mode,
                           meter=meter)
    say(LEGEND)
    note = slow_start_note([extend, decode], current_platform())
    if note:
        say(note)
    new_tokens, diverged, could = None, 0, 0
    for r in range(args.rounds):
        if new_tokens is None:
            drafter.add_requests(prompts)
            what = f"prompts, {sum(lens)} tokens"
        else:
            drafter.extend(new_tokens)
            what = f"accepted + bonus, {sum(int(t.numel()) for t in new_tokens)} tokens"
        tree = drafter.draft()
        counts, new_tokens = drafter.simulate_acceptance(tree, gen)
        d, n = lane_divergence(tree)
        diverged, could = diverged + d, could + n
        say(f"round {r}: draft extend ({what}), then {args.steps} draft steps x "
            f"{args.topk} lanes; simulated accepts {counts} (+1 bonus each)")
        for b in range(min(args.trees, args.batch)):
            for line in render_tree(tree, b, tree_mode=args.tree_mode, accepted=counts[b]):
                say("  " + line)
    say()
    if args.tree_mode == "lane" and args.topk > 1 and could:
        say(f"lane mode: {diverged} of {could} drafted nodes below depth 1 attended to their "
            "lane's history, not their ancestors' KV (upstream behaviour; --tree-mode path "
            "attends to the exact ancestry)")
    if meter is None:
        say("check against torch_ref skipped (--no-check)")
    else:
        say("outputs vs torch_ref (every attention call recomputed on the same pools):")
        for line in render_meter(meter, names):
            say(line)
    now = time.perf_counter()
    rest = (f" ({now - t0:.1f} s of draft rounds and checks; the rest: starting Python, "
            "importing torch and specattn)")
    say(f"done in {now - started:.1f} s" + (rest if t0 - started >= 0.05 else ""))
    return 0 if meter is None or meter.ok else 1


def cli_main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None,
             started: Optional[float] = None) -> int:
    """Entry point of ``specattn demo``; returns the exit status (never raises SystemExit).
    ``started``: the ``time.perf_counter()`` the printed total counts from (default: now)."""
    out = sys.stdout if out is None else out
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        model, rest = _model_choice(argv)
    except SystemExit as exc:  # a bad --model: argparse already printed
        return int(exc.code or 0)
    if model == "smollm2":
        from .smollm2.cli import cli_main as smollm2_main

        return smollm2_main(rest, out)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: argparse already printed
        return int(exc.code or 0)
    if args.min_len > args.max_len:
        print(f"specattn demo: error: --min-len {args.min_len} > --max-len {args.max_len}",
              file=sys.stderr)
        return 2
    vocab = ModelConfig.vocab_size  # every lane drafts a different token of it
    if args.topk > vocab:
        print(f"specattn demo: error: --topk {args.topk} > the model's {vocab} tokens",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("specattn demo: error: --device cuda but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    try:
        return run_demo(args, out, started)
    except SpecAttnError as exc:
        print(f"specattn demo: error: {describe_error(exc)}", file=sys.stderr)
        return 1
