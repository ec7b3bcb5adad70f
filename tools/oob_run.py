"""Small ragged rounds through a GPU backend, clean and with ``req_to_token`` entries outside
the pool, for ``compute-sanitizer --tool memcheck`` (``bash tools/gpu.sh check`` runs it).

Value checks are off (``SPECATTN_DEBUG_CHECKS`` unset: what production runs), so nothing
refuses the bad entries and the kernels must keep every read inside the pool by themselves.
The clean round is also compared with the reference (the corrupted one has no right answer).

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python tools/oob_run.py --backend triton dsa dsv4
    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python tools/oob_run.py --backend fa4 --option fa4:split_prefix=3

``--option BACKEND:KEY=VALUE`` (as ``specattn bench``'s) passes constructor keywords to the
backend's decode and extend classes that take them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.bench.options import parse_options
from specattn.data import AttentionLayer
from specattn.registry import default_registry as registry
from specattn.testing.checks import _shape_candidates
from specattn.testing.rounds import RoundMaker, random_qkv
from specattn.testing.target import Target

LENS = [1, 37, 70]


def _corrupt(runner, batch) -> None:
    """Prefix entries of the longest request past the pool's end and negative."""
    b = int(torch.argmax(batch.seq_lens.cpu()))
    row = int(batch.req_pool_indices.view(-1)[b])
    runner.req_to_token[row, 3] = runner.num_slots + 11
    runner.req_to_token[row, 5] = -7


def _run(target: Target, kind: str, model: str, page: int, corrupt: bool) -> str:
    cls = target.class_for(kind, model)
    if isinstance(cls, str):
        return f"skip ({cls})"
    dtype = torch.bfloat16 if torch.bfloat16 in cls.dtypes else cls.dtypes[0]
    tree = "path" if kind == "decode" and "path" in cls.tree_modes else "lane"
    for shape in _shape_candidates(model, target.device, False):
        maker = RoundMaker(shape, dtype, target.device, page, max(LENS) + 16, 5,
                           torch.Generator().manual_seed(1))
        try:
            backend = target.construct(cls, maker.runner, kind, 2 if kind == "decode" else 1, 3,
                                       tree)
            break
        except Exception:  # noqa: BLE001 - try the next shape
            continue
    else:
        return "skip (no shape)"
    gen = torch.Generator().manual_seed(2)
    layer = AttentionLayer(1, shape.scaling)
    rnd = maker.decode(LENS, 2, 3, tree) if kind == "decode" else \
        maker.extend([n + 3 for n in LENS], [3, 1, 4])
    if corrupt:
        _corrupt(maker.runner, rnd.batch)
    backend.init_forward_metadata(rnd.batch)
    err = 0.0
    if kind == "decode":
        for step in range(3):
            if rnd.parents_plan is not None and step:
                rnd.batch.parents[step] = rnd.parents_plan[step].to(target.device)
            q, k, v = random_qkv(maker.runner, rnd.lanes, gen)
            out = backend.forward(step, layer, q, k, v)
            if not corrupt:
                ref = reference_decode(maker.runner, layer, q, rnd.batch, step, tree)
                err = max(err, float((out.float() - ref.float()).abs().max()))
    else:
        q, k, v = random_qkv(maker.runner, rnd.num_tokens, gen)
        out = backend.forward(layer, q, k, v)
        if not corrupt:
            ref = reference_extend(maker.runner, layer, q, rnd.batch)
            err = float((out.float() - ref.float()).abs().max())
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return "ran (corrupted req_to_token)" if corrupt else f"ok (max abs error {err:.3g})"


def _constructor_options(options: list, name: str) -> dict:
    """``{kind: keywords}`` that the ``--option`` entries give backend ``name``'s decode and
    extend classes (either side may spell the backend by an alias)."""
    mine = {c for kind in ("decode", "extend") for c in registry.classes(kind)
            if name in (c.name, *c.aliases)}
    return {kind: {k: v for o in options for cls in o.classes(registry)
                   if cls in mine and cls.kind == kind
                   for k, v in o.kwargs_taken_by(cls).items()}
            for kind in ("decode", "extend")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", nargs="+", required=True)
    parser.add_argument("--option", nargs="+", default=[], metavar="BACKEND:KEY=VALUE")
    parser.add_argument("--kind", nargs="+", default=["decode", "extend"],
                        choices=["decode", "extend"])
    args = parser.parse_args()
    os.environ.pop("SPECATTN_DEBUG_CHECKS", None)
    options = parse_options(args.option)
    for name in args.backend:
        kw = _constructor_options(options, name)
        target = Target.build(name, decode_options=kw["decode"], extend_options=kw["extend"])
        for kind in args.kind:
            for model in ("mha", "mla"):
                cls = target.class_for(kind, model)  # a str: skipped (said once, at page 1)
                sizes = (1,) if isinstance(cls, str) else cls.page_sizes or (1, 64)
                pages = [1 if 1 in sizes else min(sizes)] + [64] * (64 in sizes)
                for page in dict.fromkeys(pages):
                    for corrupt in (False, True):
                        what = _run(target, kind, model, page, corrupt)
                        print(f"{name} {kind} {model} p{page}: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
