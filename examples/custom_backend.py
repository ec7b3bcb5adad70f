"""A third-party backend: subclass, pass ``name=``, and the factory can select it by name.

This one wraps the reference math (``specattn.backends.torch_ref``); a real one would launch
its own kernels in ``_attend``. Run:  python examples/custom_backend.py
"""

import torch

import specattn
from specattn import DraftDecodeBackend, DraftExtendBackend
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.platforms import any_platform


class MyDecode(DraftDecodeBackend, name="my_ref", aliases=("mine",), platforms=any_platform,
               models=("mha",), kernel_library="torch", priority=-1):
    max_topk = 8                                  # capabilities are data: validate() turns
    dtypes = (torch.bfloat16, torch.float32)      # them into readable rejection reasons

    # The base class runs the protocol (checks, the KV write, CUDA-graph buffers) and calls
    # the hooks: _plan(batch) once per round (nothing to prepare here), then per layer:
    def _attend(self, step, layer, q, k, v):      # q [B*K, H_q, D] -> o [B*K, H_q, D_v]
        return reference_decode(self.runner, layer, q, self.batch, step, self.tree_mode)


class MyExtend(DraftExtendBackend, name="my_ref", aliases=("mine",), platforms=any_platform,
               models=("mha",), kernel_library="torch", priority=-1):
    def _attend(self, layer, q, k, v):            # q [sum(E), H_q, D], causal over the prefix
        return reference_extend(self.runner, layer, q, self.batch)


def main() -> int:
    runner = specattn.DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=256, max_reqs=2,
                                      max_context_len=64, dtype=torch.float32)
    factory = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend="mine"),
                                           runner, topk=2, num_steps=3)
    print(factory.explain_decode_backend().explain())
    decode, extend = factory.create_decode_backend(), factory.create_draft_extend_backend()
    assert decode is not None and extend is not None  # "mine" registers both
    layer, q = specattn.AttentionLayer(0, scaling=32 ** -0.5), torch.randn(5, 4, 32)
    # Request 0: a prompt of 5 tokens in slots 1..5, then one draft step of 2 lanes.
    runner.req_to_token[0, :5] = torch.arange(1, 6, dtype=torch.int32)
    one = lambda *v: torch.tensor(v)  # noqa: E731
    extend.init_forward_metadata(specattn.DraftExtendBatch(one(0), one(5), one(5),
                                                           torch.arange(1, 6)))
    o = extend.forward(layer, q, torch.randn(5, 2, 32), torch.randn(5, 2, 32))
    decode.init_forward_metadata(specattn.DraftBatch(one(0), one(5),
                                                     torch.arange(10, 16).view(1, 2, 3)))
    o = decode.forward(0, layer, torch.randn(2, 4, 32), torch.randn(2, 2, 32),
                       torch.randn(2, 2, 32))
    print(f"selected {type(decode).__name__} / {type(extend).__name__}; decode output "
          f"{tuple(o.shape)}, finite: {bool(torch.isfinite(o).all())}")
    print("topk=16 would be refused:", MyDecode.validate(runner.backend_request("decode", topk=16)))
    # The conformance kit: the whole contract against the reference, from the declared
    # capabilities (raises ConformanceError, with every failed case, if one fails).
    from specattn.testing import check_backend

    print(check_backend([MyDecode, MyExtend]).summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
