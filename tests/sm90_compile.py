"""Compiling captured kernel launches for sm90 without a GPU (the compile tests' shared part).

A test calls a launcher on CPU tensors with its kernel replaced by ``Capture``, then compiles
each captured launch with ``compile_launch`` the way Triton's launcher would specialise it, in
a child process without ``TRITON_INTERPRET`` (``in_child``: under the interpreter Triton's own
library functions cannot be compiled); ``sass_counts`` reads the build's instructions,
registers and spills.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

H200_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm90
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
          torch.float8_e5m2: "fp8e5"}


class Capture:
    """Stands for a kernel: ``kernel[grid](*args, **constexprs)`` records the launch."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.fn, grid, args, kw))


def compile_launch(fn, args, kw: dict, gluon: bool = False):
    """Compile a captured launch ``fn[grid](*args, **kw)`` for sm90: tensors as typed pointers
    (16-byte aligned), ints of value 1 as constants, other ints divisible by 16 marked so,
    constexprs with defaults that were not passed at their defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    options = {k: kw[k] for k in ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")
               if k in kw}
    consts = {k: v for k, v in kw.items() if k not in options}
    consts.update({p.name: p.default for p in fn.params
                   if p.is_constexpr and p.has_default and p.name not in consts})
    names = [n for n in fn.arg_names if n not in consts]
    assert len(names) == len(args), f"{fn.__name__}: {len(args)} arguments for {names}"
    sig, attrs = {}, {}
    for name, value in zip(names, args):
        index = fn.arg_names.index(name)
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: {value!r}")
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name in consts:
        sig[name] = "constexpr"
    sig = {n: sig[n] for n in fn.arg_names}
    source = (GluonASTSource if gluon else ASTSource)(fn, sig, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=options)


def in_child(script: str, case: dict, timeout: float = 900) -> dict:
    """``python script JSON(case)`` without ``TRITON_INTERPRET``, this checkout's specattn
    first on the path: the JSON object its last line prints."""
    import specattn

    root = os.path.dirname(os.path.dirname(os.path.abspath(specattn.__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.abspath(script), json.dumps(case)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_counts(cubin: bytes, ops: "re.Pattern[str]") -> dict:
    """The instructions ``ops`` matches in a cubin's SASS, by name, and its registers / spills
    (``cuobjdump -res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"STACK:(\d+)", usage)
    return dict(collections.Counter(ops.findall(sass)), regs=int(regs.group(1)) if regs else -1,
                stack=int(spills.group(1)) if spills else -1)
