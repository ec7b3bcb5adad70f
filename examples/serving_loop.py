"""A minimal EAGLE draft serving loop on specattn, the way an engine uses it.

The engine owns its KV pools and request table; specattn wraps them (no copy), the factory
picks the backends, and each round runs a draft extend then ``S`` top-k draft steps.
Runs anywhere (CPU: seconds):  python examples/serving_loop.py [--backend auto] [--tree-mode path]
"""

import argparse

import torch

import specattn
from specattn.allocator import PagedKVAllocator

B, K, S, P = 3, 4, 4, 16                        # requests, topk, draft steps, page size
LAYERS, HQ, HKV, D, VOCAB = 2, 8, 2, 64, 128    # draft model shape (GQA)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tree-mode", choices=("lane", "path"), default="path")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    dev, dt = ("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    # The engine's tensors: request -> slot table and one K and one V pool per layer.
    req_to_token = torch.zeros(8, 512, dtype=torch.int32, device=dev)
    k_pool = [torch.zeros(4096, HKV, D, dtype=dt, device=dev) for _ in range(LAYERS)]
    v_pool = [torch.zeros(4096, HKV, D, dtype=dt, device=dev) for _ in range(LAYERS)]
    runner = specattn.DraftRunner.wrap_mha(req_to_token, k_pool, v_pool, num_q_heads=HQ,
                                           page_size=P)
    config = specattn.SpecConfig(attention_backend=args.backend, page_size=P)
    factory = specattn.DraftBackendFactory(config, runner, topk=K, num_steps=S,
                                           tree_mode=args.tree_mode)
    extend, decode = factory.create_draft_extend_backend(), factory.create_decode_backend()
    if extend is None or decode is None:  # no draft extend (flashmla); decode: S >= 2 has one
        raise SystemExit(f"{args.backend!r} has no draft-extend backend: pass another --backend")
    print(f"platform {specattn.platforms.current_platform()}: extend backend "
          f"{type(extend).name!r}, decode backend {type(decode).name!r}")

    # A stand-in draft model: embeddings, one q/k/v projection per layer, LM head.
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(dev, dt)
    emb, head = rand(VOCAB, HQ * D) * 8, rand(HQ * D, VOCAB) * 4
    wqkv = [rand(HQ * D, (HQ + 2 * HKV) * D) for _ in range(LAYERS)]
    layers = [specattn.AttentionLayer(i, scaling=D ** -0.5) for i in range(LAYERS)]

    def model(ids, attend):                     # ids [T] -> logits [T, VOCAB]
        x = emb[ids]
        for layer, w in zip(layers, wqkv):
            q, k, v = (x @ w).split([HQ * D, HKV * D, HKV * D], dim=-1)
            o = attend(layer, q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D))
            x = x + o.reshape(-1, HQ * D)
        return (x @ head).float()

    alloc = PagedKVAllocator(runner)            # stands in for the engine's own allocator
    reqs = [alloc.new_request() for _ in range(B)]
    rpi = torch.tensor(reqs, device=dev)
    new = [torch.randint(VOCAB, (n,), generator=gen) for n in (20, 45, 70)]  # prompts
    for r in range(args.rounds):
        # 1. Draft extend: the new tokens (prompt, later accepted + bonus) over the prefix.
        locs = torch.cat([alloc.extend(q, len(t)) for q, t in zip(reqs, new)])
        seq_lens = alloc.seq_lens(reqs)
        ext = torch.tensor([len(t) for t in new], device=dev)
        extend.init_forward_metadata(specattn.DraftExtendBatch(rpi, seq_lens, ext, locs))
        logits = model(torch.cat(new).to(dev), extend.forward)
        score, ids = logits[ext.cumsum(0) - 1].softmax(-1).topk(K)      # [B, K] depth 1
        # 2. S draft steps with EAGLE top-k: expand K*K, keep K, parent lane = index // K.
        out_cache_loc = alloc.alloc_draft(rpi, K, S)                    # [B, K, S] scratch
        parents = torch.zeros(S, B, K, dtype=torch.int64, device=dev)
        decode.init_forward_metadata(specattn.DraftBatch(rpi, seq_lens, out_cache_loc, parents))
        tokens = [ids]
        for i in range(S - 1):
            logits = model(ids.reshape(-1), lambda *a, i=i: decode.forward(i, *a))
            p, tok = logits.softmax(-1).topk(K)                         # [B*K, K]
            score, best = (score[:, :, None] * p.view(B, K, K)).view(B, K * K).topk(K)
            ids = tok.view(B, K * K).gather(1, best)
            parents[i + 1] = best // K          # in place, before step i + 1 runs
            tokens.append(ids)
        alloc.release_draft()
        # 3. "Verify" (no target here): accept a prefix of the best path, add a bonus token.
        lane, picked = score.argmax(-1), []
        for i in range(S - 1, -1, -1):
            picked.append(tokens[i].gather(1, lane[:, None]))
            lane = parents[i].gather(1, lane[:, None])[:, 0]
        path = torch.cat(picked[::-1], dim=1).cpu()                     # [B, S]
        n_acc = torch.randint(0, S + 1, (B,), generator=gen)
        new = [torch.cat([path[b, :n_acc[b]], torch.randint(VOCAB, (1,), generator=gen)])
               for b in range(B)]
        print(f"round {r}: extended {int(ext.sum())} tokens, drafted {S}x{K} per request, "
              f"best paths {path.tolist()}, accepted {n_acc.tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
