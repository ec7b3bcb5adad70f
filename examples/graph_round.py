"""Draft decode rounds replayed from one CUDA graph, the way an engine runs batch 1 to 8.

Once: the backend's fixed buffers, the capture-time metadata, a warm-up, then the draft
layer's ``S - 1`` steps captured into a graph whose inputs are fixed tensors. Every round:
the round's batch (its own requests, lengths and draft slots; fewer than the captured size
are padded) goes to ``init_forward_metadata_replay_cuda_graph``, the step inputs are copied
into the fixed tensors, the graph replays. Each round is checked against ``torch_ref`` run
eagerly on the same pools. Without CUDA the same calls run eagerly (no capture).
Runs anywhere (CPU: seconds):  python examples/graph_round.py [--backend auto] [--rounds 3]
"""

import argparse

import torch

import specattn
from specattn.allocator import PagedKVAllocator

MAX_BS, K, S = 2, 4, 4                # captured batch size, lanes, draft slots per lane
HQ, HKV, D = 8, 2, 64                 # one GQA draft layer
PREFIX = (300, 1000)                  # the two requests' committed tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    dev, dt = ("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    req_to_token = torch.zeros(4, 2048, dtype=torch.int32, device=dev)
    k_pool = [torch.randn(4096, HKV, D, generator=gen).to(dev, dt)]
    v_pool = [torch.randn(4096, HKV, D, generator=gen).to(dev, dt)]
    runner = specattn.DraftRunner.wrap_mha(req_to_token, k_pool, v_pool, num_q_heads=HQ)
    factory = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend=args.backend),
                                           runner, topk=K, num_steps=S)
    decode = factory.create_decode_backend()
    reference = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend="torch_ref"),
                                             runner, topk=K, num_steps=S).create_decode_backend()
    assert decode is not None and reference is not None  # num_steps >= 2: a decode backend
    layer = specattn.AttentionLayer(0, scaling=D ** -0.5)

    alloc = PagedKVAllocator(runner)  # stands in for the engine's allocator
    reqs = [alloc.new_request() for _ in PREFIX]
    for req, n in zip(reqs, PREFIX):
        alloc.extend(req, n)

    def round_batch(requests: list) -> specattn.DraftBatch:
        """This round's requests, their lengths (and the host copy an engine keeps) and
        ``K x S`` fresh draft slots per request."""
        rpi = torch.tensor(requests, device=dev)
        seq_lens = alloc.seq_lens(requests)
        return specattn.DraftBatch(rpi, seq_lens, alloc.alloc_draft(rpi, K, S),
                                   seq_lens_cpu=seq_lens.cpu())

    # The graph's inputs and the steps it runs: q, k, v of every lane at each step.
    qkv = [(torch.zeros(MAX_BS * K, HQ, D, dtype=dt, device=dev),
            torch.zeros(MAX_BS * K, HKV, D, dtype=dt, device=dev),
            torch.zeros(MAX_BS * K, HKV, D, dtype=dt, device=dev)) for _ in range(S - 1)]

    def steps() -> list:
        return [decode.forward(i, layer, *qkv[i]) for i in range(S - 1)]

    decode.init_cuda_graph_state(MAX_BS, MAX_BS * K)
    decode.init_forward_metadata_capture_cuda_graph(round_batch(reqs))
    graph, outs = None, []
    if dev == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            steps()  # warm-up: kernels compile, workspaces and plans for the layers' scale
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = steps()
    alloc.release_draft()
    print(f"platform {specattn.platforms.current_platform()}: decode backend "
          f"{type(decode).name!r}, {'captured CUDA graph' if graph else 'eager (no CUDA)'}")

    worst = 0.0
    for r in range(args.rounds):
        requests = reqs if r % 2 == 0 else reqs[1:]  # odd rounds: one request, padded to 2
        batch = round_batch(requests)
        decode.init_forward_metadata_replay_cuda_graph(batch, MAX_BS)
        for q, k, v in qkv:  # the draft model's projections would write these
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen).to(dt))
        if graph is not None:
            graph.replay()
        else:
            outs = steps()
        lanes, err = len(requests) * K, 0.0
        reference.init_forward_metadata(batch)
        for i in range(S - 1):
            want = reference.forward(i, layer, *(t[:lanes] for t in qkv[i])).float()
            got = outs[i][:lanes].float()
            err = max(err, ((got - want).abs().max() / want.abs().max()).item())
        worst = max(worst, err)
        print(f"round {r}: {len(requests)} of {MAX_BS} requests, lengths "
              f"{batch.seq_lens.tolist()}, {S - 1} steps, max error against torch_ref "
              f"{err:.1e}")
        alloc.release_draft()
        for req in requests:  # one accepted token per request before the next round
            alloc.extend(req, 1)
    ok = worst < 2e-2
    print("replays match torch_ref" if ok else f"replays differ from torch_ref: {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
