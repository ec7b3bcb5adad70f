"""Print the signatures of the vendor entry points specattn's glue calls, as installed here.

Run on a GPU host after a library upgrade, before reading any failure: a renamed or removed
keyword shows here first. Libraries that are not installed are said to be so; nothing is
called, so no GPU is needed.

Usage: ``python tools/library_signatures.py [--library flashinfer ...]``
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
from typing import Optional

# module -> attribute paths of the entry points the backends (and bench baselines) call
ENTRY_POINTS = {
    "flashinfer": [f"{cls}.{method}" for cls in (
        "BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
        "mla.BatchMLAPagedAttentionWrapper") for method in ("__init__", "plan", "run")]
    + ["merge_state"],
    "flash_attn.cute": ["flash_attn_varlen_func"],
    "flash_attn_interface": ["flash_attn_with_kvcache", "flash_attn_varlen_func"],
    "flash_mla": ["flash_mla_with_kvcache", "get_mla_metadata"],
}


def signatures(module_name: str) -> list[str]:
    """One line per entry point of ``module_name``: ``name(signature)``, or why not."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not installed, or broken: say which
        return [f"{module_name}: not importable ({type(exc).__name__}: {exc})"]
    version = getattr(module, "__version__", "?")
    lines = [f"{module_name} {version}"]
    for path in ENTRY_POINTS[module_name]:
        try:
            entry = functools.reduce(getattr, path.split("."), module)
            lines.append(f"  {path}{inspect.signature(entry)}")
        except (AttributeError, TypeError, ValueError) as exc:
            lines.append(f"  {path}: {type(exc).__name__}: {exc}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", nargs="+", choices=sorted(ENTRY_POINTS),
                    default=sorted(ENTRY_POINTS), help="modules to look at (default: all)")
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"torch {torch.__version__}; {gpu}")
    for name in args.library:
        print("\n".join(signatures(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
