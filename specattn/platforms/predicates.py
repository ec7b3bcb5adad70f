"""Platform predicates: small named callables that describe themselves.

A ``Predicate`` is called with a ``Platform`` and returns a bool; its ``description`` is the
human text used in "needs ..." reasons. They combine with ``|``, ``&`` and ``~``::

    platforms = is_cuda | is_hip | is_xpu | (is_cpu & triton_interpret)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidInputError
from ..install import install_hint
from .interface import Platform

__all__ = [
    "Predicate", "is_cuda", "is_hip", "is_npu", "is_musa", "is_xpu", "is_cpu", "is_hopper",
    "is_blackwell", "cpu_has_amx", "is_cpu_with_amx", "triton_interpret", "cuda_capability",
    "any_platform", "has_library",
]


@dataclass(frozen=True, repr=False)
class Predicate:
    fn: Callable[[Platform], bool]
    description: str

    def __post_init__(self) -> None:
        # Checked here, where the declaration is written: a bad one would otherwise fail
        # at the first selection, `specattn list` or `auto`, for every backend.
        if not callable(self.fn):
            raise InvalidInputError("Predicate.fn", "a callable taking a Platform",
                                    repr(self.fn))
        if not isinstance(self.description, str) or not self.description:
            raise InvalidInputError("Predicate.description", "a non-empty str",
                                    repr(self.description))

    def __call__(self, platform: Platform) -> bool:
        return bool(self.fn(platform))

    def __or__(self, other: "Predicate") -> "Predicate":
        _operand("|", other)
        return Predicate(lambda p: self(p) or other(p),
                         f"{self.description} or {other.description}")

    def __and__(self, other: "Predicate") -> "Predicate":
        _operand("&", other)
        return Predicate(lambda p: self(p) and other(p),
                         f"{_paren(self)} and {_paren(other)}")

    def __invert__(self) -> "Predicate":
        return Predicate(lambda p: not self(p), f"not {_paren(self)}")

    def __str__(self) -> str:
        return self.description

    def __repr__(self) -> str:
        return f"Predicate({self.description!r})"


def _operand(op: str, other: object) -> None:
    if not isinstance(other, Predicate):
        raise InvalidInputError(f"the right operand of {op}", "a specattn.platforms.Predicate "
                                "(a function wrapped as Predicate(fn, description))",
                                type(other).__name__)


def _paren(p: Predicate) -> str:
    return f"({p.description})" if " or " in p.description else p.description


def _device(name: str, text: str) -> Predicate:
    return Predicate(lambda p: p.device == name, text)


is_cuda = _device("cuda", "CUDA")
is_hip = _device("hip", "ROCm (HIP)")
is_npu = _device("npu", "an Ascend NPU")
is_musa = _device("musa", "MUSA")
is_xpu = _device("xpu", "an Intel XPU")
is_cpu = _device("cpu", "the CPU")
any_platform = Predicate(lambda p: True, "any platform")


def cuda_capability(*majors: int, minors: tuple[int, ...] | None = None) -> Predicate:
    """CUDA with compute capability major in ``majors`` (and minor in ``minors`` if given)."""
    majors_text = "/".join(f"{m}.x" for m in majors) if minors is None else "/".join(
        f"{m}.{n}" for m in majors for n in minors)

    def check(p: Platform) -> bool:
        if p.device != "cuda" or p.capability is None:
            return False
        major, minor = p.capability
        return major in majors and (minors is None or minor in minors)

    return Predicate(check, f"CUDA compute capability {majors_text}")


is_hopper = cuda_capability(9)
# Blackwell as the recent upstream helper defines it: SM100, SM110 and SM120 families.
is_blackwell = cuda_capability(10, 11, 12)
# The host CPU's AMX flag, whatever the device (a CUDA machine's host may have it too).
cpu_has_amx = Predicate(lambda p: p.cpu_has_amx, "AMX on the host CPU")
# Running on the CPU, and that CPU has AMX: one description, not "the CPU and AMX on the host
# CPU", for the route to ``intel_amx`` as ``specattn select`` and the docs print it.
is_cpu_with_amx = Predicate(lambda p: p.device == "cpu" and p.cpu_has_amx, "a CPU with AMX")
triton_interpret = Predicate(lambda p: p.triton_interpret, "TRITON_INTERPRET=1")


def has_library(module: str, pip_name: str | None = None) -> Predicate:
    """The vendor module is importable here (probed without importing)."""
    hint = f" ({install_hint(pip_name)})" if pip_name else ""
    return Predicate(lambda p: p.has_library(module), f"the '{module}' package{hint}")
