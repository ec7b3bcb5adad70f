"""How a kit case ends other than passing: ``CaseFailed`` (the backend broke the contract) or
``CaseSkipped`` (the case does not apply). Their own module: ``checks`` raises them and
re-exports them, ``target`` raises ``CaseSkipped`` when a caller's option does not fit."""

from __future__ import annotations

__all__ = ["CaseFailed", "CaseSkipped"]


class CaseFailed(Exception):
    """The backend broke the contract; the message says where and how."""


class CaseSkipped(Exception):
    """The case does not apply (capability not declared, feature refused clearly)."""
