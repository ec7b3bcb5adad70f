"""The conformance kit on the ``triton`` backend with the CuTe-DSL MLA kernel forced
(config ``cute``): every MLA decode case the kit plans, against the reference, on an sm90 GPU
with CuTe-DSL (the FA4 part of the offline bundle). The kernel's own tests are the ``cute``
variant of ``test_gluon_mla_gpu.py``. Marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
CUTE = "m64 n64 w8 s2 kv-first gluon cute"


def test_conformance_kit_with_the_cute_config():
    pytest.importorskip("cutlass.cute", reason="CuTe-DSL is not installed (FA4 bundle)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe-DSL MLA kernel is built for sm90")
    from specattn.bench.options import kernel_config
    from specattn.testing import check_backend

    report = check_backend("triton", device="cuda", kinds=("decode",), models=("mla",),
                           level="full", decode_options={"config": kernel_config(CUTE)},
                           raise_on_failure=False)
    print(report)
    assert report.ok, report
    # Cases the kernel does not serve (fp32, FP8 layouts, per-branch mode) are skipped; the
    # rest must have run.
    assert report.passed >= 10, report
