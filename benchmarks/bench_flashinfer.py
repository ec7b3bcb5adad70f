"""Benchmark the FlashInfer backends per ``performance.md`` (one step, one layer).

For each case (uniform, and ragged lengths in [L/2, 3L/2]): the time of one draft-decode
``forward`` at step 2 (3 history tokens: KV write + prefix pass + history/merge), in the
``shared`` (prefix once per request) and ``per-branch`` (upstream) modes, timed as the replay
of a CUDA graph over rotating layers (KV read per call larger than L2), median of
``triton.testing.do_bench``; the copy-bandwidth floor measured in the same process; and the
host cost of the metadata (eager ``init_forward_metadata`` per round, and the graph replay's
re-plan). Shared-mode rows also time the parts: ``write_kv``, the prefix pass with the
graph plan this glue makes, with FlashInfer's default graph plan (no ``uniform_q_len`` /
``disable_split_kv``: what v1 ran) and with an eager plan; the fused history + merge kernel
(reading the pool after ``write_kv``, and storing the new KV itself, as the step now runs);
and, for comparison, v1's history pass (FlashInfer decode wrapper, graph plan) +
``merge_state``. Draft extend: eager plan and graph plan.

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
    """Where the time of the gqa-long shared-prefix step goes, and prefix-pass variants
    (eager plans)."""
    from specattn.backends.flashinfer import FlashInferDecode
    from specattn.backends.flashinfer._history import history_merge

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
        o_p, l_p = rnd.prefix.run(q, 0)
        hist = be._history(step, B * K)
        t_h, _ = timed(lambda lay: history_merge(q, *be._history_pools(lay.layer_id), hist, o_p,
                                                 l_p, be.params.scale, 0.0), lyr)
        print(f"sweep {tag:10s} write_kv {t_w * 1e3:.1f} us, history + merge kernel "
              f"{t_h * 1e3:.1f} us", flush=True)
        del r, be
        torch.cuda.empty_cache()


def v1_history(be, B, N, n, q):
    """v1's history pass (graph-mode FlashInfer decode over each lane's ``n`` slots, LSE)
    plus ``merge_state``, on ``be``'s runner: returns ``fn(layer, o_p, lse_p)``."""
    import flashinfer

    from specattn.backends.flashinfer._passes import DecodePass, MLAPass

    r = be.runner
    cls = MLAPass if r.use_mla_backend else DecodePass
    hp = cls(r, with_lse=True, graph_rows=N, capacity=N * n)
    hp.indices[:N * n] = be._history(n - 1, N).reshape(-1).to(torch.int32)
    qo = torch.arange(N + 1, dtype=torch.int32)
    hp.plan(qo, qo * n, N * n, False, be.params)

    def fn(lay, o_p, lse_p):
        o_h, lse_h = hp.run(q, lay.layer_id)
        return flashinfer.merge_state(o_p, lse_p, o_h, lse_h)
    return fn


def decode_parts(cls, r, batch, B, N, K, S, step, q, k, v, lyr, be, eager):
    """Shared mode: the parts of one step (ms each)."""
    from specattn.backends.flashinfer._history import history_merge

    parts = {}
    loc = batch.out_cache_loc[:, :, step].reshape(-1)
    parts["write_kv"], _ = timed(lambda lay: r.write_kv(lay.layer_id, loc, k, v), lyr)
    rnd = be._graphs[B]
    parts["prefix"], _ = timed(lambda lay: rnd.prefix.run(q, lay.layer_id), lyr)
    if not r.use_mla_backend:  # FlashInfer's default graph plan (v1)
        old = cls(r, K, S)
        old.prefix_plan_kwargs = {"uniform_q_len": None, "disable_split_kv": False}
        old.init_cuda_graph_state(B, N)
        old.init_forward_metadata_capture_cuda_graph(batch)
        old.forward(0, lyr[0], q, k, v)
        p_old = old._graphs[B].prefix
        parts["prefix_default_graph_plan"], _ = timed(lambda lay: p_old.run(q, lay.layer_id),
                                                      lyr)
        del old
    p_eager = eager._eager.prefix
    parts["prefix_eager_plan"], _ = timed(lambda lay: p_eager.run(q, lay.layer_id), lyr)
    o_p, lse_p = rnd.prefix.run(q, 0)
    hist = be._history(step, N)
    params = be.params
    parts["history_merge"], _ = timed(
        lambda lay: history_merge(q, *be._history_pools(lay.layer_id), hist, o_p, lse_p,
                                  params.scale, params.cap), lyr)
    # What the step runs now: the same kernel storing the new KV (replaces write_kv).
    parts["history_merge_storing_kv"], _ = timed(
        lambda lay: history_merge(q, *be._history_pools(lay.layer_id), hist, o_p, lse_p,
                                  params.scale, params.cap, k_new=k, v_new=v), lyr)
    try:
        fn = v1_history(be, B, N, step + 1, q)
        parts["v1_history_pass_merge"], _ = timed(lambda lay: fn(lay, o_p, lse_p), lyr)
    except Exception as e:  # a comparison only
        print(f"  v1 history pass: FAILED {type(e).__name__}: {e}", flush=True)
    return parts


def bench_decode(model, lens, K, S, mode, bw, step=2):
    from specattn.backends.flashinfer import FlashInferDecode, FlashInferMLADecode

    cls = FlashInferMLADecode if model == "mla" else FlashInferDecode
    prefix_backend = "auto"
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
    parts = {}
    if be._graphs[B].prefix is not None:
        eager = cls(r, K, S, mode=mode)
        eager.init_forward_metadata(batch)
        eager.forward(0, lyr[0], q, k, v)
        parts = decode_parts(cls, r, batch, B, N, K, S, step, q, k, v, lyr, be, eager)
    floor = (sum(lens) + N * (step + 1)) * row_bytes(model) / bw * 1e3
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=parts.get("prefix"),
                meta_host_ms=t_meta, replay_plan_host_ms=t_replay, parts=parts)


def bench_extend(lens, S, bw):
    from specattn.backends.flashinfer import FlashInferExtend

    E, B = S + 1, len(lens)
    layers = layers_for(lens, "mha")
    r, rpi, seq, _ = build("mha", lens, 0, layers)
    loc = torch.cat([r.req_to_token[rpi[b], L - E:L].long() for b, L in enumerate(lens)])
    batch = DraftExtendBatch(rpi, seq, torch.full((B,), E, device=DEV), loc)
    (q, k, v), scale = inputs("mha", B * E)
    lyr = [AttentionLayer(i, scale) for i in range(layers)]
    be = FlashInferExtend(r)
    be.init_forward_metadata(batch)
    be.forward(lyr[0], q, k, v)
    t_eager, _ = timed(lambda lay: be.forward(lay, q, k, v), lyr)
    t_meta = host_ms(lambda: be.init_forward_metadata(batch))
    # CUDA-graph path: graph-mode plan on fixed buffers, re-planned before each replay.
    be.init_cuda_graph_state(B, B * E)
    be.init_forward_metadata_capture_cuda_graph(batch)
    t, how = timed(lambda lay: be.forward(lay, q, k, v), lyr)
    t_replay = host_ms(lambda: be.init_forward_metadata_replay_cuda_graph(batch, B))
    floor = sum(lens) * row_bytes("mha") / bw * 1e3
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=None, meta_host_ms=t_meta,
                replay_plan_host_ms=t_replay, parts={"eager_plan": t_eager})


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
                parts = d.pop("parts")
                row = dict(case=name, lengths="ragged" if ragged else "uniform", mode=mode, **d)
                row["parts_us"] = " ".join(f"{p}={ms * 1e3:.1f}" for p, ms in parts.items())
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
                if parts:
                    print(f"{'':10s} parts (us): {row['parts_us']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "flashinfer-bench-v2.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["case"])
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
