"""Soak every CPU environment of the conformance suite: the vendor glue against its stand-in
libraries and the native backends (Triton under ``TRITON_INTERPRET=1``), ``SECONDS`` each.

    python tools/cpu_soak.py [SECONDS] [ENV ...]     # default 40 s, every environment

Rounds are small (prefixes up to 120) and runs of 10 seeds share a configuration, so the
interpreter compiles less; a failure prints its seed (replay: ``--same-config 10``).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "conformance")]
os.environ.setdefault("TRITON_INTERPRET", "1")

from environments import NATIVE, STANDIN  # noqa: E402

from specattn.testing.soak import soak  # noqa: E402


def main(argv=None) -> int:
    envs = {e.label: e for e in STANDIN + NATIVE}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seconds", nargs="?", type=float, default=40.0,
                    help="seconds of random rounds per environment (default 40)")
    ap.add_argument("envs", nargs="*", metavar="ENV",
                    help=f"environments (default: every one): {', '.join(envs)}")
    args = ap.parse_args(argv)
    unknown = [name for name in args.envs if name not in envs]
    if unknown:
        ap.error(f"ENV: one of {', '.join(envs)}, not {unknown[0]!r}")
    seconds, names = args.seconds, args.envs or list(envs)
    failed = 0
    for label in names:
        env = envs[label]
        result = soak(env.name, rounds=10**6, max_len=120, max_seconds=seconds,
                      same_config=10, log=lambda *_: None, **env.options())
        print(f"{label}: {result.summary()}", flush=True)
        for seed, case, why in result.failures[:10]:
            print(f"  seed {seed}: {case}: {why[:300]}", flush=True)
        failed += len(result.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
