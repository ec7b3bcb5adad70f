"""Benchmark the FlashInfer backends per ``performance.md`` (one step, one layer).

For each case (uniform, and ragged lengths in [L/2, 3L/2]): the time of one draft-decode
``forward`` at step 2 (3 history tokens: KV write + passes + merge), in the ``shared``
(prefix once per request) and ``per-branch`` (upstream) modes, timed as the replay of a CUDA
graph over rotating layers (KV read per call larger than L2), median of
``triton.testing.do_bench``; the prefix pass alone; the copy-bandwidth floor measured in the
same process; and the host cost of the metadata (eager ``init_forward_metadata`` per round,
and the graph replay's re-plan). Draft extend likewise.

Usage: ``python benchmarks/bench_flashinfer.py [--out DIR] [--cases a,b] [--signatures]``.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import copy_bandwidth, timed  # noqa: E402
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner  # noqa: E402

DEV = "cuda"
CASES = {
    # name: (model, B, L, K, S)  (page size does not matter: pools are seen as page 1)
    "gqa-long": ("mha", 32, 4096, 8, 5),
    "gqa-chain": ("mha", 64, 2048, 1, 4),
    "gqa-paged": ("mha", 32, 4096, 4, 5),
    "gqa-small": ("mha", 4, 1024, 4, 5),
    "mla-long": ("mla", 32, 4096, 4, 5),
    "extend": ("mha", 32, 4096, 0, 5),
}
L2_BYTES = 50 * 2 ** 20
SWEEP_CASE = (32, 4096, 8, 5, 2)  # gqa-long: B, L, K, S, step


def signatures() -> None:
    """The FlashInfer entry points the glue calls, as installed."""
    import flashinfer

    print("flashinfer", flashinfer.__version__, "torch", torch.__version__,
          torch.cuda.get_device_name(), "cap", torch.cuda.get_device_capability())
    targets = {
        "BatchPrefillWithPagedKVCacheWrapper.__init__":
            flashinfer.BatchPrefillWithPagedKVCacheWrapper.__init__,
        "BatchPrefillWithPagedKVCacheWrapper.plan":
            flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan,
        "BatchPrefillWithPagedKVCacheWrapper.run":
            flashinfer.BatchPrefillWithPagedKVCacheWrapper.run,
        "BatchDecodeWithPagedKVCacheWrapper.__init__":
            flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__,
        "BatchDecodeWithPagedKVCacheWrapper.plan":
            flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan,
        "BatchDecodeWithPagedKVCacheWrapper.run":
            flashinfer.BatchDecodeWithPagedKVCacheWrapper.run,
        "merge_state": flashinfer.merge_state,
        "mla.BatchMLAPagedAttentionWrapper.__init__":
            flashinfer.mla.BatchMLAPagedAttentionWrapper.__init__,
        "mla.BatchMLAPagedAttentionWrapper.plan":
            flashinfer.mla.BatchMLAPagedAttentionWrapper.plan,
        "mla.BatchMLAPagedAttentionWrapper.run":
            flashinfer.mla.BatchMLAPagedAttentionWrapper.run,
        "mla.MLAPlanMetadata.csr": flashinfer.mla.MLAPlanMetadata.csr,
    }
    for name, fn in targets.items():
        try:
            print(f"{name}{inspect.signature(fn)}")
        except (TypeError, ValueError) as e:
            print(f"{name}: {e}")


def row_bytes(model: str) -> int:
    return 576 * 2 if model == "mla" else 8 * 256 * 2


def build(model, lens, extra_slots, layers, contiguous=False):
    """Runner with random pools; request rows over shuffled slots (``contiguous``: in order,
    as a fresh allocator hands them out); returns the free slots."""
    B = len(lens)
    num_slots = sum(lens) + extra_slots + 16
    kw = dict(num_layers=layers, num_slots=num_slots, max_reqs=B,
              max_context_len=max(lens) + 16, device=DEV)
    if model == "mha":
        r = DraftRunner.mha(32, 8, 128, **kw)
        pools = r.k_buffer + r.v_buffer
    else:
        r = DraftRunner.mla(16, 512, 64, **kw)
        pools = r.kv_buffer
    for p in pools:
        p.normal_()
    slots = ((torch.arange(num_slots - 1, device=DEV) if contiguous
              else torch.randperm(num_slots - 1, device=DEV)) + 1).to(torch.int32)
    rpi = torch.randperm(B, device=DEV)
    used = 0
    for b, L in enumerate(lens):
        r.req_to_token[rpi[b], :L] = slots[used:used + L]
        used += L
    return r, rpi, torch.tensor(lens, device=DEV), slots[used:].long()


def layers_for(lens, model):
    per_layer = sum(lens) * row_bytes(model)
    return max(2, min(12, -(-3 * L2_BYTES // per_layer)))


def host_ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def inputs(model, n):
    bf = torch.bfloat16
    if model == "mha":
        return (torch.randn(n, 32, 128, device=DEV, dtype=bf),
                torch.randn(n, 8, 128, device=DEV, dtype=bf),
                torch.randn(n, 8, 128, device=DEV, dtype=bf)), 128 ** -0.5
    return (torch.randn(n, 16, 576, device=DEV, dtype=bf),
            torch.randn(n, 576, device=DEV, dtype=bf), None), 192 ** -0.5


def sweep(bw) -> None:
    """Where the time of the gqa-long shared-prefix step goes, and prefix-pass variants."""
    import flashinfer

    from specattn.backends.flashinfer import FlashInferDecode

    B, L, K, S, step = SWEEP_CASE
    lens = [L] * B
    for contiguous in (False, True):
        layers = layers_for(lens, "mha")
        r, rpi, seq, free = build("mha", lens, B * K * S, layers, contiguous=contiguous)
        batch = DraftBatch(rpi, seq, free[:B * K * S].reshape(B, K, S), None)
        (q, k, v), scale = inputs("mha", B * K)
        lyr = [AttentionLayer(i, scale) for i in range(layers)]
        floor = (sum(lens) + B * K * (step + 1)) * row_bytes("mha") / bw * 1e3
        tag = "contiguous" if contiguous else "random"
        variants = [("fa3", {}), ("fa2", {})]
        if not contiguous:
            variants += [("fa2", {"fixed_split_size": n}) for n in (512, 1024, 2048)]
            variants += [("fa2", {"disable_split_kv": True}), ("fa3", {"fixed_split_size": 1024})]
        for backend, kw in variants:
            try:
                be = FlashInferDecode(r, K, S)
                be.prefix_backend, be.prefix_plan_kwargs = backend, kw
                be.init_forward_metadata(batch)
                be.forward(0, lyr[0], q, k, v)
                rnd = be._eager
                t, _ = timed(lambda lay: rnd.prefix.run(q, lay.layer_id), lyr)
                line = f"prefix {backend} {kw}: {t * 1e3:.1f} us"
                if not kw:
                    for i in range(1, step):
                        be.forward(i, lyr[0], q, k, v)
                    tf, _ = timed(lambda lay: be.forward(step, lay, q, k, v), lyr)
                    line += f"; whole step {tf * 1e3:.1f} us ({tf / floor:.2f}x floor)"
                print(f"sweep {tag:10s} {line}", flush=True)
            except Exception as e:
                print(f"sweep {tag} prefix {backend} {kw}: FAILED {type(e).__name__}: {e}",
                      flush=True)
        if contiguous:
            pb = FlashInferDecode(r, K, S, mode="per-branch")
            pb.init_forward_metadata(batch)
            for i in range(step):
                pb.forward(i, lyr[0], q, k, v)
            t, _ = timed(lambda lay: pb.forward(step, lay, q, k, v), lyr)
            print(f"sweep {tag:10s} per-branch whole step {t * 1e3:.1f} us", flush=True)
            continue
        be = FlashInferDecode(r, K, S)
        be.init_forward_metadata(batch)
        for i in range(step + 1):
            be.forward(i, lyr[0], q, k, v)
        rnd = be._eager
        loc = batch.out_cache_loc[:, :, step].reshape(-1)
        t_w, _ = timed(lambda lay: r.write_kv(lay.layer_id, loc, k, v), lyr)
        t_h, _ = timed(lambda lay: rnd.steps[step].run(q, lay.layer_id), lyr)
        o_p, l_p = rnd.prefix.run(q, 0)
        o_h, l_h = rnd.steps[step].run(q, 0)
        t_m, _ = timed(lambda lay: flashinfer.merge_state(o_p, l_p, o_h, l_h), lyr)
        print(f"sweep {tag:10s} write_kv {t_w * 1e3:.1f} us, history pass {t_h * 1e3:.1f} us, "
              f"merge_state {t_m * 1e3:.1f} us", flush=True)
        del r, be
        torch.cuda.empty_cache()


def bench_decode(model, lens, K, S, mode, bw, step=2):
    from specattn.backends.flashinfer import FlashInferDecode, FlashInferMLADecode

    cls = FlashInferMLADecode if model == "mla" else FlashInferDecode
    prefix_backend = "auto"
    if mode == "shared-fa2":  # the prefix pass on FlashInfer's fa2 prefill kernel
        mode, prefix_backend = "shared", "fa2"
    B, N = len(lens), len(lens) * K
    layers = layers_for(lens, model)
    r, rpi, seq, free = build(model, lens, N * S, layers)
    batch = DraftBatch(rpi, seq, free[:N * S].reshape(B, K, S), None)
    (q, k, v), scale = inputs(model, N)
    lyr = [AttentionLayer(i, scale) for i in range(layers)]
    # Host cost of one eager round (plan of every step the loop runs).
    eager = cls(r, K, S, mode=mode)
    eager.prefix_backend = prefix_backend
    eager.init_forward_metadata(batch)
    eager.forward(0, lyr[0], q, k, v)  # learns the layer's scale (re-plan once)
    t_meta = host_ms(lambda: eager.init_forward_metadata(batch))
    del eager
    be = cls(r, K, S, mode=mode)
    be.prefix_backend = prefix_backend
    be.init_cuda_graph_state(B, N)
    be.init_forward_metadata_capture_cuda_graph(batch)
    for i in range(step):
        be.forward(i, lyr[0], q, k, v)
    t, how = timed(lambda lay: be.forward(step, lay, q, k, v), lyr)
    t_replay = host_ms(lambda: be.init_forward_metadata_replay_cuda_graph(batch, B))
    t_prefix = None
    rnd = be._graphs[B]
    if rnd.prefix is not None:
        t_prefix, _ = timed(lambda lay: rnd.prefix.run(q, lay.layer_id), lyr)
    floor = (sum(lens) + N * (step + 1)) * row_bytes(model) / bw * 1e3
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=t_prefix, meta_host_ms=t_meta,
                replay_plan_host_ms=t_replay)


def bench_extend(lens, S, bw):
    from specattn.backends.flashinfer import FlashInferExtend

    E, B = S + 1, len(lens)
    layers = layers_for(lens, "mha")
    r, rpi, seq, _ = build("mha", lens, 0, layers)
    loc = torch.cat([r.req_to_token[rpi[b], L - E:L].long() for b, L in enumerate(lens)])
    batch = DraftExtendBatch(rpi, seq, torch.full((B,), E, device=DEV), loc)
    be = FlashInferExtend(r)
    be.init_forward_metadata(batch)
    (q, k, v), scale = inputs("mha", B * E)
    t, how = timed(lambda lay: be.forward(lay, q, k, v),
                   [AttentionLayer(i, scale) for i in range(layers)])
    t_meta = host_ms(lambda: be.init_forward_metadata(batch))
    floor = sum(lens) * row_bytes("mha") / bw * 1e3
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=None, meta_host_ms=t_meta,
                replay_plan_host_ms=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--signatures", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if args.signatures:
        signatures()
        return
    if args.sweep:
        sweep(copy_bandwidth())
        return
    rng = random.Random(0)
    bw = copy_bandwidth()
    drv = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    import flashinfer

    print(f"# {drv}; torch {torch.__version__}; flashinfer {flashinfer.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in args.cases.split(","):
        model, B, L, K, S = CASES[name]
        for ragged in (False, True):
            if ragged and name not in ("gqa-long", "mla-long", "extend"):
                continue
            lens = [rng.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]
            modes = ["-"] if name == "extend" else (["shared"] if K == 1
                                                    else ["shared", "per-branch"])
            if model == "mha" and K > 1 and not ragged:
                modes.insert(1, "shared-fa2")
            res = {}
            for mode in modes:
                try:
                    res[mode] = (bench_extend(lens, S, bw) if name == "extend"
                                 else bench_decode(model, lens, K, S, mode, bw))
                except Exception as e:  # keep going: one failing case must not hide others
                    print(f"{name} {mode}: FAILED {type(e).__name__}: {e}", flush=True)
                torch.cuda.empty_cache()
            base = res.get("per-branch")
            for mode, d in res.items():
                row = dict(case=name, lengths="ragged" if ragged else "uniform", mode=mode, **d)
                row["x_floor"] = d["ms"] / d["floor_ms"]
                row["speedup_vs_per_branch"] = (base["ms"] / d["ms"]) if base else None
                rows.append(row)
                pre = f" prefix {d['prefix_ms'] * 1e3:.0f} us" if d["prefix_ms"] else ""
                sp = (f" {row['speedup_vs_per_branch']:.2f}x vs per-branch"
                      if row["speedup_vs_per_branch"] else "")
                rp = (f", replay plan {d['replay_plan_host_ms']:.2f} ms"
                      if d["replay_plan_host_ms"] is not None else "")
                print(f"{name:10s} {row['lengths']:7s} {mode:10s} {d['ms'] * 1e3:8.1f} us "
                      f"({d['timing']}) floor {d['floor_ms'] * 1e3:6.1f} us "
                      f"{row['x_floor']:.2f}x floor{sp}{pre}; host metadata/round "
                      f"{d['meta_host_ms']:.2f} ms{rp}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "flashinfer-bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["case"])
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
