"""A/B of the Triton kernels' fusions on the H200, one run: who writes the new KV
(``kv_write``: torch indexed copies = v3, one Triton launch, the attention kernel's tail
programs or its first prefix split) and the partial merge in the last program of each tile
(``fuse_merge``) vs its own launch, per standard case.

Usage: ``python benchmarks/ab_triton_fusion.py [--out DIR] [--cases a,b]
[--variants "kv-first; n32 s3 waves=2" --check --ragged]`` (CUDA only). A variant is a list of
changes to each case's default config: ``mN nN wN sN`` (block_m, block_n, warps, stages),
``kv-<write>``, ``fm`` (fused merge), ``waves=X``; ``--check`` first compares each decode
variant with ``torch_ref`` (``sweep_triton.check_decode``); ``--ragged`` adds the ragged-length
run of each case.
Same timing as ``bench_triton.py`` (one forward at step 2, layers rotated past L2, CUDA-graph
replay, do_bench median); the floor is from the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))

import bench_triton as bt  # noqa: E402
from _common import copy_bandwidth, run_line  # noqa: E402


def default_config(model: str, K: int, extend: bool):
    from specattn.backends.triton import launchers

    shape = launchers.AttnShape(16, 1, 512, 64, 512, True) if model == "mla" else \
        launchers.AttnShape(32, 8, 128, 0, 128, False)
    rows = (bt.CASES["extend"][4] + 1 if extend else K) * shape.group
    return launchers.choose_config(shape, rows)


VARIANTS = [  # (kv_write, fuse_merge, waves or None for the default)
    ("torch", False, None), ("kernel", False, None), ("tail", False, None),
    ("first", False, None), ("first", True, None)]
EXTRA = {"extend": [("first", False, 1.0), ("first", True, 1.0), ("kernel", False, 1.0)]}


_FIELDS = {"m": "block_m", "n": "block_n", "w": "num_warps", "s": "num_stages"}


def parse_variant(spec: str):
    """``"n32 s3 kv-first waves=2"`` -> ``(config changes, waves or None, label)``."""
    changes, waves = {}, None
    for tok in spec.split():
        if tok.startswith("waves="):
            waves = float(tok[6:])
        elif tok.startswith("kv-"):
            changes["kv_write"] = tok[3:]
        elif tok == "fm":
            changes["fuse_merge"] = True
        elif tok[0] in _FIELDS and tok[1:].isdigit():
            changes[_FIELDS[tok[0]]] = int(tok[1:])
        else:
            raise SystemExit(f"unknown variant token {tok!r} in {spec!r}")
    return changes, waves, spec.strip() or "default"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="gqa-long,gqa-long-k1,gqa-paged,gqa-small,mla-long,"
                                       "mla-long-p64,extend")
    ap.add_argument("--variants", default=None,
                    help="';'-separated config changes (see the module docstring); default: "
                         "the kv_write / fuse_merge set")
    ap.add_argument("--check", action="store_true",
                    help="compare each decode variant with torch_ref before timing it")
    ap.add_argument("--ragged", action="store_true", help="also time ragged lengths")
    args = ap.parse_args()
    bw = copy_bandwidth()
    text = (f"# Triton fusion A/B\n\n{run_line(bw)}\n\n"
            "| case | lengths | variant | waves | time us | x floor | splits | config |\n"
            "|---|---|---|---|---|---|---|---|\n")
    print(text, end="", flush=True)
    rng = random.Random(0)
    for name in args.cases.split(","):
        model, B, L, K, S, P = bt.CASES[name]
        extend = name == "extend"
        base = default_config(model, K, extend)
        if args.variants is not None:
            runs = [parse_variant(v) for v in args.variants.split(";")]
        else:
            runs = [(dict(kv_write=kw, fuse_merge=fm), waves,
                     f"kv_write={kw}" + (" + merge fused" if fm else ""))
                    for kw, fm, waves in VARIANTS + EXTRA.get(name, [])]
        for ragged in (False, True) if args.ragged else (False,):
            lens = bt.lens_for(B, L, ragged, rng)
            for changes, waves, lab in runs:
                try:
                    cfg = dataclasses.replace(base, **changes)
                    if args.check and not extend:
                        from sweep_triton import check_decode

                        err = check_decode(model, cfg, K=K)
                        lab += f" (err {err:.1e})"
                    if extend:
                        t, floor, info = bt.bench_extend(B, lens, S, bw, cfg, waves)
                    else:
                        t, floor, info = bt.bench_decode(model, B, lens, K, S, P, "shared", bw,
                                                         cfg, waves)
                except Exception as e:  # report, keep going
                    line = f"| {name} | {'ragged' if ragged else 'uniform'} | {lab} | " \
                           f"{waves or 'default'} | FAILED {e!r} | | | |\n"
                else:
                    line = (f"| {name} | {'ragged' if ragged else 'uniform'} | {lab} | "
                            f"{waves or 'default'} | {t * 1e3:.1f} | {t / floor:.2f} | "
                            f"{info['splits']} | {info['cfg'].label()} |\n")
                print(line, end="", flush=True)
                text += line
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "triton-fusion-ab.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
