"""Host time of the replay metadata call, an older package against this one, in one process.

    python tools/host_ab.py REF --case gqa-b8-p16-extend mla-b8-p64 --backend flashinfer

REF holds an older ``specattn/`` package (``mkdir -p .ab && git archive TAG specattn | tar -x
-C .ab``, as for ``tools/gpu.sh ab``). It is imported as ``specattn_ref`` (the package imports
itself relatively), and for each case and backend the two packages' calls are timed in
alternating rounds: each round builds the backend, captures the graph round's metadata, warms
it up and takes ``parts.host_us`` (the median of ``--calls`` calls, each on an idle device).
A host whose timings move between processes (the H200's moves by up to 2x) still gives a
fair comparison this way; ``specattn bench``'s ``host us`` is the absolute number.

Output: a markdown table (stdout, and ``--out FILE``), per case and backend the rounds' medians
of both packages in us and the ratio of their medians (this / REF).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REF_NAME = "specattn_ref"
WARM_UP_CALLS = 30


def import_ref(ref: Path, into: Path) -> Any:
    """``ref/specattn`` copied to ``into/specattn_ref`` and imported under that name."""
    src = ref / "specattn"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"host_ab: {ref} holds no specattn/ package")
    shutil.copytree(src, into / REF_NAME, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(into))
    return importlib.import_module(REF_NAME)


def replay_host_us(pkg: str, case_name: str, backend: str, device: str, calls: int,
                   setups: dict) -> Optional[float]:
    """Median host us of package ``pkg``'s ``backend`` replay metadata call at ``case_name``
    (``None``: the backend does not run that case here)."""
    cases = importlib.import_module(f"{pkg}.bench.cases")
    harness = importlib.import_module(f"{pkg}.bench.harness")
    parts = importlib.import_module(f"{pkg}.bench.parts")
    platforms = importlib.import_module(f"{pkg}.platforms")
    by_name = {c.name: c for group in cases.CASE_SETS.values() for c in group}
    if case_name not in by_name:
        raise SystemExit(f"host_ab: {pkg} has no case {case_name!r}")
    case = by_name[case_name]
    key = (pkg, case_name)
    if key not in setups:
        setups[key] = harness.build_setup(case, device, max_layers=1)
    setup = setups[key]
    variants, _ = harness.discover_variants(case, platforms.current_platform(), [backend],
                                            raw=False, on_gpu=device == "cuda")
    variant = next((v for v in variants if v.label == backend), None)
    if variant is None:
        return None
    b = variant.make(setup)
    b.init_cuda_graph_state(case.batch, case.lanes)
    b.init_forward_metadata_capture_cuda_graph(setup.batch)

    def call() -> None:
        b.init_forward_metadata_replay_cuda_graph(setup.batch, case.batch)
    for _ in range(WARM_UP_CALLS):
        call()
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return parts.host_us(call, sync, reps=calls)


def table(rows: list[tuple[str, str, list, list]]) -> str:
    """The markdown table of ``(case, backend, ref us per round, this us per round)``."""
    out = ["| case | backend | REF us (rounds) | this us (rounds) | this / REF |",
           "|---|---|---|---|---|"]
    for case, backend, ref, this in rows:
        if None in ref or None in this:
            out.append(f"| {case} | {backend} | n/a | n/a | - |")
            continue
        ratio = statistics.median(this) / statistics.median(ref)
        out.append(f"| {case} | {backend} | {' / '.join(f'{x:.1f}' for x in ref)} | "
                   f"{' / '.join(f'{x:.1f}' for x in this)} | {ratio:.2f} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ref", type=Path, help="a folder holding the older specattn/ package")
    ap.add_argument("--case", nargs="+", required=True, help="bench case names")
    ap.add_argument("--backend", nargs="+", required=True, help="variant labels")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--calls", type=int, default=300, help="timed calls a round (default 300)")
    ap.add_argument("--device", default=None, help="default: cuda where there is one")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        import_ref(args.ref, Path(tmp))
        setups: dict = {}
        for case in args.case:
            for backend in args.backend:
                ref, this = [], []
                for _ in range(args.rounds):
                    ref.append(replay_host_us(REF_NAME, case, backend, device, args.calls,
                                              setups))
                    this.append(replay_host_us("specattn", case, backend, device,
                                               args.calls, setups))
                rows.append((case, backend, ref, this))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    text = table(rows)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
