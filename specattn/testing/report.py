"""What the kit ran, skipped and found: ``CaseResult``, ``ConformanceReport``,
``ConformanceError``."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PASSED", "FAILED", "SKIPPED", "LIMIT", "CaseResult", "ConformanceReport",
           "ConformanceError"]

PASSED, FAILED, SKIPPED, LIMIT = "passed", "failed", "skipped", "declared limit"


@dataclass
class CaseResult:
    """One case: its id (``decode/mha/numerics/bf16/k3/p1/path/ragged``), outcome and why."""

    case: str
    status: str
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        mark = {PASSED: "PASS", FAILED: "FAIL", SKIPPED: "SKIP", LIMIT: "LIMIT"}[self.status]
        text = f"{mark:5} {self.case}"
        if self.detail:
            text += f": {self.detail}"
        return text


@dataclass
class ConformanceReport:
    """Every case the kit planned for one backend, with its outcome."""

    target: str
    device: str
    platform: str
    results: list[CaseResult] = field(default_factory=list)

    def _count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> int:
        return self._count(PASSED)

    @property
    def failed(self) -> int:
        return self._count(FAILED)

    @property
    def skipped(self) -> int:
        return self._count(SKIPPED)

    @property
    def limits(self) -> int:
        return self._count(LIMIT)

    @property
    def ok(self) -> bool:
        """No case failed (skips and declared limits are reported, not failures)."""
        return self.failed == 0

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == FAILED]

    def summary(self) -> str:
        seconds = sum(r.seconds for r in self.results)
        return (f"specattn conformance of {self.target} on {self.device} ({self.platform}): "
                f"{len(self.results)} cases, {self.passed} passed, {self.failed} failed, "
                f"{self.skipped} skipped, {self.limits} declared limits ({seconds:.1f} s)")

    def __str__(self) -> str:
        order = {FAILED: 0, PASSED: 1, LIMIT: 2, SKIPPED: 3}
        lines = [self.summary()]
        lines += ["  " + r.line() for r in sorted(self.results,
                                                   key=lambda r: order[r.status])]
        return "\n".join(lines)


class ConformanceError(AssertionError):
    """Raised by ``check_backend`` when a case failed; ``report`` holds every result."""

    def __init__(self, report: ConformanceReport):
        failures = "\n".join("  " + r.line() for r in report.failures)
        super().__init__(f"{report.summary()}\n{failures}")
        self.report = report
