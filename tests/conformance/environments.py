"""Where each built-in backend runs the conformance kit.

On a machine where a backend's own platform and library are present (the H200 for triton,
flashinfer, fa4, fa3-through-FA4, flashmla, dsa, dsv4), ``native`` environments run it for
real. Everywhere, backends for hardware this machine lacks run on the CPU against the
stand-in vendor modules of ``tests/standins`` (documented signatures, answers computed with
torch from exactly the arguments they receive) under a platform that has the library.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from specattn.platforms import Platform, current_platform, triton_interpret_enabled
from standins import aiter as aiter_standin
from standins import flash_mla as fm_standin
from standins import flashinfer as fi_standin
from standins import tokenspeed_mla as ts_standin
from standins import torch_npu as npu_standin
from standins import trtllm_flashinfer as trt_standin
from standins.flash_attn_family import flash_attn_modules, swapped_modules


@contextlib.contextmanager
def _patched(obj, **attrs) -> Iterator[None]:
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def _flashinfer() -> Iterator[None]:
    from specattn.backends import flashinfer as fi_backends
    from specattn.backends.flashinfer import _passes, _prefill_plan, _replan

    classes = (fi_backends.FlashInferDecode, fi_backends.FlashInferExtend,
               fi_backends.FlashInferMLADecode, fi_backends.FlashInferMLAExtend)
    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped_modules({"flashinfer": fi_standin.make()}))
        # The stand-in computes in float32, so the glue is checked at fp32 tolerance too.
        for cls in classes:
            stack.enter_context(_patched(cls, dtypes=cls.dtypes + (torch.float32,)))
        stack.enter_context(_patched(_passes, _WORKSPACE_BYTES=16, _WORKSPACES={}))
        # The stand-in's FA2 planner counts fi_standin.SMS SMs (the CPU has none).
        stack.enter_context(_patched(_prefill_plan, sm_count=lambda device: fi_standin.SMS))
        stack.enter_context(_patched(_replan, sm_count=lambda device: fi_standin.SMS))
        yield


@contextlib.contextmanager
def _flash_attn() -> Iterator[None]:
    with swapped_modules(flash_attn_modules()):
        yield


def _installer(make: Callable[[], dict[str, types.ModuleType]]):
    @contextlib.contextmanager
    def setup() -> Iterator[None]:
        with swapped_modules(make()):
            yield
    return setup


def _trtllm_modules() -> dict[str, types.ModuleType]:
    root, _ = trt_standin.make()
    return {"flashinfer": root, "flashinfer.decode": root.decode, "flashinfer.mla": root.mla}


def _aiter_modules() -> dict[str, types.ModuleType]:
    aiter, mla, _ = aiter_standin.make()
    return {"aiter": aiter, "aiter.mla": mla}


@dataclass(frozen=True)
class Environment:
    """One way to run ``name``: ``platform`` (None: this machine), ``setup`` (stand-ins)."""

    label: str
    name: str
    platform: Optional[Platform] = None
    setup: Optional[Callable] = None
    device: Optional[str] = None
    covers: tuple[str, ...] = field(default=())  # "name[flavour]" of the classes it runs
    extra: tuple[tuple[str, Any], ...] = ()  # more conformance_tests options

    def options(self) -> dict:
        return {"platform": self.platform, "setup": self.setup, "device": self.device,
                **dict(self.extra)}


def _lib(device: str, capability=None, *libs: str) -> Platform:
    return Platform(device, capability, libraries=frozenset(libs))


HOPPER_FA4 = _lib("cuda", (9, 0), "flash_attn.cute")
# fa4 with its prefix split in three (decode and extend), a route its defaults take only
# for long prefixes at small batches.
FA4_SPLIT = (("decode_options", {"split_prefix": 3}), ("extend_options", {"split_prefix": 3}))
STANDIN = (
    Environment("flashinfer", "flashinfer", _lib("cuda", (9, 0), "flashinfer"), _flashinfer,
                "cpu", ("flashinfer[mha]", "flashinfer[mla]")),
    Environment("fa4", "fa4", HOPPER_FA4, _flash_attn, "cpu", ("fa4[cuda]",)),
    Environment("fa4-split", "fa4", HOPPER_FA4, _flash_attn, "cpu", ("fa4[cuda]",),
                extra=FA4_SPLIT),
    Environment("fa3-sm90", "fa3", _lib("cuda", (9, 0), "flash_attn_interface"), _flash_attn,
                "cpu", ("fa3[sm90]",)),
    Environment("fa3-sm8x", "fa3", _lib("cuda", (8, 0), "flash_attn_interface"), _flash_attn,
                "cpu", ("fa3[sm8x]",)),
    Environment("fa-musa", "fa4", _lib("musa", None, "mate"), _flash_attn, "cpu",
                ("fa4[musa]", "fa3[musa]")),
    Environment("flashmla", "flashmla", _lib("cuda", (9, 0), "flash_mla"),
                _installer(lambda: {"flash_mla": fm_standin.make()[0]}), "cpu",
                ("flashmla[default]",)),
    Environment("trtllm_mha", "trtllm_mha", _lib("cuda", (10, 0), "flashinfer"),
                _installer(_trtllm_modules), "cpu", ("trtllm_mha[default]",)),
    Environment("trtllm_mla", "trtllm_mla", _lib("cuda", (10, 0), "flashinfer"),
                _installer(_trtllm_modules), "cpu", ("trtllm_mla[default]",)),
    Environment("cutedsl_mla", "cutedsl_mla", _lib("cuda", (10, 0), "flashinfer"),
                _installer(_trtllm_modules), "cpu", ("cutedsl_mla[default]",)),
    Environment("tokenspeed_mla", "tokenspeed_mla", _lib("cuda", (10, 0), "tokenspeed_mla"),
                _installer(lambda: {"tokenspeed_mla": ts_standin.make()[0]}), "cpu",
                ("tokenspeed_mla[default]",)),
    Environment("aiter", "aiter", _lib("hip", None, "aiter"), _installer(_aiter_modules),
                "cpu", ("aiter[default]",)),
    Environment("ascend", "ascend", _lib("npu", None, "torch_npu"),
                _installer(lambda: {"torch_npu": npu_standin.make()[0]}), "cpu",
                ("ascend[default]",)),
    Environment("dsv4-npu", "dsv4", _lib("npu", None, "torch_npu"),
                _installer(lambda: {"torch_npu": npu_standin.make()[0]}), "cpu",
                ("dsv4[npu]",)),
    Environment("dsv4-hip", "dsv4", _lib("hip", None, "triton"), None, "cpu",
                ("dsv4[hip]",)),
)
# Backends whose kernels run on this machine's own platform (CPU: torch, or Triton under
# TRITON_INTERPRET=1; on the H200 the same names run their CUDA kernels).
NATIVE = (
    Environment("torch_ref", "torch_ref", covers=("torch_ref[default]",)),
    Environment("intel_amx", "intel_amx", covers=("intel_amx[default]",)),
    Environment("triton", "triton", covers=("triton[default]",)),
    Environment("dsa", "dsa", covers=("dsa[default]",)),
    Environment("dsv4", "dsv4", covers=("dsv4[cuda]",)),
)
# On a GPU with the libraries installed, the vendor backends also run natively.
GPU_NATIVE = (
    Environment("flashinfer-gpu", "flashinfer", covers=("flashinfer[mha]", "flashinfer[mla]")),
    Environment("fa4-gpu", "fa4", covers=("fa4[cuda]",)),
    Environment("fa4-split-gpu", "fa4", covers=("fa4[cuda]",), extra=FA4_SPLIT),
    Environment("fa3-gpu", "fa3", covers=("fa3[sm90]",)),
    Environment("flashmla-gpu", "flashmla", covers=("flashmla[default]",)),
)


def environments() -> tuple[Environment, ...]:
    """The environments to run on this machine: native, the vendor libraries for real where
    ``current_platform()`` has them (GPU), and the stand-ins where Triton's interpreter is on:
    their backends' Triton kernels (slot lists, merges) run on the CPU, which takes it
    (``tests/conftest.py`` turns it on where there is no GPU; on a GPU host, run them with
    ``TRITON_INTERPRET=1``)."""
    platform = current_platform()
    gpu = tuple(e for e in GPU_NATIVE if platform.device == "cuda")
    return NATIVE + gpu + (STANDIN if triton_interpret_enabled() else ())
