"""Timing helpers shared by the GPU benchmark scripts (``bench_triton.py``,
``bench_flash_attn.py``, ``bench_flashinfer.py``); importable because each script's folder
is first on ``sys.path`` when it runs.

- ``copy_bandwidth()``: the copy floor, measured in the same process as the kernels.
- ``run_line(bw)``: "date | GPU | torch | triton | CUDA | copy bandwidth" for a report.
- ``timed(fn, layers)``: median ms of one ``fn(layer)`` call under a CUDA graph that rotates
  through ``layers`` (so the KV read each call is larger than L2).
"""

from __future__ import annotations

import torch

DEV = "cuda"


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    import triton

    src = torch.randn(2 ** 29, device=DEV)
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300,
                                return_mode="median")
    return 2 * src.numel() * 4 / (t * 1e-3)


def run_line(bw: float) -> str:
    """When and where a report was measured (``bw``: copy bandwidth, bytes/s)."""
    import time

    import triton

    return (f"{time.strftime('%Y-%m-%d %H:%M')} | {torch.cuda.get_device_name(0)} | "
            f"torch {torch.__version__} | triton {triton.__version__} | "
            f"CUDA {torch.version.cuda} | copy bandwidth {bw / 1e12:.2f} TB/s")


def timed(fn, layers, *, eager_fallback: bool = True) -> tuple[float, str]:
    """Median ms of one call: a CUDA graph runs ``fn`` once per layer; its replay time over
    the layer count, and ``"graph"``. If capture fails: with ``eager_fallback`` the failure
    is printed and the calls are timed eagerly (``"eager"``), else the error propagates."""
    import triton

    for lay in layers:
        fn(lay)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for lay in layers:
                fn(lay)
        t = triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")
        return t / len(layers), "graph"
    except Exception as e:  # report, then time eagerly
        if not eager_fallback:
            raise
        print(f"  graph capture failed ({type(e).__name__}: {e}); eager timing", flush=True)
        torch.cuda.synchronize()
        t = triton.testing.do_bench(lambda: [fn(lay) for lay in layers], warmup=10, rep=100,
                                    return_mode="median")
        return t / len(layers), "eager"
