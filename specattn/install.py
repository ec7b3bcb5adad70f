"""Install hints: the command that installs a vendor library, as specattn prints it.

A backend declares ``requires=((module, requirement), ...)``; ``requirement`` is a pip
requirement spelled exactly as an extra of ``pyproject.toml`` spells it (a test keeps the two
equal), so the printed ``pip install ...`` line installs a version the backend was written
for. Libraries that are not on the Python package index get a sentence instead.
"""

from __future__ import annotations

import re

__all__ = ["install_hint", "NOT_ON_PYPI"]

# Requirement -> how to get it, for libraries that pip cannot install from the index.
NOT_ON_PYPI = {
    "mate": "'mate', the MUSA FlashAttention port, is not on PyPI, whose 'mate' is an "
            "unrelated project: install it with the MUSA software stack, see docs/install.md",
}

# Characters a POSIX shell would interpret (a requirement like 'x>=1,<2' needs quotes).
_SHELL_SPECIAL = re.compile(r"[\s<>|&;()$`\"'*?\[\]!{}\\]")


def install_hint(requirement: str) -> str:
    """The command (or sentence) that installs ``requirement``, ready to copy into a shell.

    >>> install_hint("flash-attn-4~=4.0.0b36")
    'pip install flash-attn-4~=4.0.0b36'
    >>> install_hint("x>=1,<2")
    "pip install 'x>=1,<2'"
    """
    if requirement in NOT_ON_PYPI:
        return NOT_ON_PYPI[requirement]
    quoted = f"'{requirement}'" if _SHELL_SPECIAL.search(requirement) else requirement
    return f"pip install {quoted}"
