"""CPU draft-attention throughput: ``intel_amx`` against ``torch_ref`` on this machine.

Usage::

    python benchmarks/bench_cpu.py [--quick] [--dtype bf16] [--threads 1 --clock cpu]
                                   [--out table.md]

For each case it times one layer's attention for a whole draft round (steps ``0 .. S-2``,
what the serving loop runs) or one draft extend, and prints tokens/s (query rows per second,
best of ``--reps`` runs) for ``intel_amx`` with and without its per-round prefix cache, a
per-branch formulation (each lane its own SDPA sequence, reading the prefix ``K`` times: the
upstream design on CPU) and ``torch_ref``, with the ratios to ``torch_ref``. On a shared
machine ``--threads 1 --clock cpu`` (process CPU time) gives the steadiest numbers.
The cases are the standard ones of ``performance.md`` scaled down for a small CPU. Not run
by the tests.
"""

from __future__ import annotations

import argparse
import platform as host_platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from specattn import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.allocator import PagedKVAllocator
from specattn.backends.intel_amx import IntelAMXDecode, IntelAMXExtend
from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend
from specattn.metadata import history_slots
from specattn.platforms import current_platform


@dataclass
class Case:
    name: str
    mla: bool
    bs: int
    seq_len: int
    topk: int
    steps: int
    page_size: int
    extend: bool = False


CASES = [
    Case("gqa-small", False, 4, 1024, 4, 5, 1),
    Case("gqa-k8", False, 4, 1024, 8, 5, 1),
    Case("gqa-chain", False, 8, 1024, 1, 4, 1),
    Case("gqa-paged", False, 4, 1024, 4, 5, 16),
    Case("mla-small", True, 4, 1024, 4, 5, 1),
    Case("extend", False, 8, 1024, 1, 5, 1, extend=True),
]


def _runner(case: Case, dtype: torch.dtype) -> DraftRunner:
    slots = case.bs * (case.seq_len + 2 * case.topk * (case.steps + case.page_size)) + 64
    slots = -(-slots // case.page_size) * case.page_size + case.page_size
    ctx = case.seq_len + case.topk * (case.steps + case.page_size) + 8
    if case.mla:
        runner = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=slots,
                                 max_reqs=case.bs, max_context_len=ctx,
                                 page_size=case.page_size, dtype=dtype)
        runner.kv_buffer[0].normal_()
    else:
        runner = DraftRunner.mha(32, 8, 128, num_layers=1, num_slots=slots, max_reqs=case.bs,
                                 max_context_len=ctx, page_size=case.page_size, dtype=dtype)
        runner.k_buffer[0].normal_()
        runner.v_buffer[0].normal_()
    return runner


def _qkv(runner: DraftRunner, rows: int):
    dt = runner.dtype
    if runner.use_mla_backend:
        width = runner.kv_lora_rank + runner.qk_rope_head_dim
        return (torch.randn(rows, runner.num_heads, width, dtype=dt),
                torch.randn(rows, width, dtype=dt), None)
    return (torch.randn(rows, runner.num_q_heads, runner.head_dim, dtype=dt),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim, dtype=dt),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim, dtype=dt))


_CLOCK = time.perf_counter


def _best_time(fn: Callable[[], None], reps: int) -> float:
    """Best of ``reps`` times after a warm-up: on a shared CPU the minimum is the run least
    disturbed by other processes."""
    fn()
    times = []
    for _ in range(reps):
        t0 = _CLOCK()
        fn()
        times.append(_CLOCK() - t0)
    return min(times)


class _PerBranch:
    """Each lane as its own sequence (prefix + history), one SDPA per lane: the upstream
    per-branch design, reading every prefix ``K`` times. MHA only; the baseline."""

    def __init__(self, runner: DraftRunner, topk: int, num_steps: int) -> None:
        self.runner, self.topk, self.num_steps = runner, topk, num_steps

    def init_forward_metadata(self, batch: DraftBatch) -> None:
        self.batch = batch

    def forward(self, step, layer, q, k, v):
        r, b = self.runner, self.batch
        r.write_kv(layer.layer_id, b.out_cache_loc[:, :, step], k, v)
        hist = history_slots(b.out_cache_loc, None, step, "lane").long()
        group = r.num_q_heads // r.num_kv_heads
        out = torch.empty(q.shape[0], r.num_q_heads, r.v_head_dim, dtype=q.dtype)
        for i in range(b.batch_size):
            prefix = r.req_to_token[int(b.req_pool_indices[i]), :int(b.seq_lens[i])].long()
            for j in range(self.topk):
                slots = torch.cat([prefix, hist[i, j]])
                kk = r.k_buffer[layer.layer_id][slots].transpose(0, 1)
                vv = r.v_buffer[layer.layer_id][slots].transpose(0, 1)
                z = i * self.topk + j
                qq = q[z].view(r.num_kv_heads, group, -1)
                o = F.scaled_dot_product_attention(qq, kk, vv, scale=layer.scaling)
                out[z] = o.reshape(r.num_q_heads, -1)
        return out


def _decode_round_time(case: Case, runner: DraftRunner, make, reps: int) -> float:
    alloc = PagedKVAllocator(runner)
    reqs = []
    for _ in range(case.bs):
        req = alloc.new_request()
        alloc.extend(req, case.seq_len)
        reqs.append(req)
    rpi = torch.tensor(reqs, dtype=torch.int64)
    seq_lens = alloc.seq_lens(reqs)
    loc = alloc.alloc_draft(rpi, case.topk, case.steps)
    batch = DraftBatch(rpi, seq_lens, loc)
    backend = make(runner, case.topk, case.steps)
    layer = AttentionLayer(0, 0.088)
    inputs = [_qkv(runner, case.bs * case.topk) for _ in range(case.steps - 1)]

    def round_():
        backend.init_forward_metadata(batch)
        for step in range(case.steps - 1):
            backend.forward(step, layer, *inputs[step])

    return _best_time(round_, reps)


def _extend_time(case: Case, runner: DraftRunner, make, reps: int) -> float:
    alloc = PagedKVAllocator(runner)
    reqs, new = [], []
    ext = case.steps + 1
    for _ in range(case.bs):
        req = alloc.new_request()
        alloc.extend(req, case.seq_len)
        new.append(alloc.extend(req, ext))
        reqs.append(req)
    batch = DraftExtendBatch(torch.tensor(reqs), alloc.seq_lens(reqs),
                             torch.full((case.bs,), ext), torch.cat(new))
    backend = make(runner)
    layer = AttentionLayer(0, 0.088)
    q, k, v = _qkv(runner, case.bs * ext)

    def run():
        backend.init_forward_metadata(batch)
        backend.forward(layer, q, k, v)

    return _best_time(run, reps)


def bench(case: Case, dtype: torch.dtype, reps: int) -> dict[str, Optional[float]]:
    """tokens/s per implementation (None where it does not apply)."""
    runner = _runner(case, dtype)
    if case.extend:
        tokens = case.bs * (case.steps + 1)
        makers = {"intel_amx": lambda r: IntelAMXExtend(r), "torch_ref": TorchRefExtend}
        return {name: tokens / _extend_time(case, runner, make, reps)
                for name, make in makers.items()}
    tokens = case.bs * case.topk * (case.steps - 1)
    makers = {
        "intel_amx": lambda r, k, s: IntelAMXDecode(r, k, s),
        "intel_amx (no prefix cache)": lambda r, k, s: IntelAMXDecode(r, k, s,
                                                                      cache_prefix=False),
        "per-branch SDPA": None if case.mla else _PerBranch,
        "torch_ref": TorchRefDecode,
    }
    return {name: None if make is None else
            tokens / _decode_round_time(case, runner, make, reps)
            for name, make in makers.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a quarter of the prefix length")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="cpu: process CPU time, steadier on a shared machine (use with "
                        "--threads 1)")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    global _CLOCK
    _CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    plat = current_platform()
    lines = [
        f"# intel_amx vs torch_ref, {args.dtype}, one layer, {args.clock} clock",
        "",
        f"{host_platform.processor() or host_platform.machine()}, {plat}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{IntelAMXDecode.runtime_note(plat)}",
        "",
        "| case | B | L | K | S | P | impl | tokens/s | x torch_ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for case in CASES:
        if args.quick:
            case.seq_len //= 4
        rates = bench(case, dtype, args.reps)
        ref = rates["torch_ref"]
        for name, rate in rates.items():
            if rate is None:
                continue
            row = (f"| {case.name} | {case.bs} | {case.seq_len} | {case.topk} | {case.steps} | "
                   f"{case.page_size} | {name} | {rate:,.0f} | {rate / ref:.1f} |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
