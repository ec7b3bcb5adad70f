"""Built-in backends: importing this package registers every one of them.

Each vendor module imports on any machine; vendor libraries are imported only inside the
code paths that launch their kernels.
"""

from . import (  # noqa: F401  (imported for registration)
    aiter,
    ascend,
    dsa,
    dsv4,
    flash_attn,
    flashinfer,
    flashmla,
    hybrid,
    intel_amx,
    tokenspeed,
    torch_ref,
    triton,
    trtllm,
)
