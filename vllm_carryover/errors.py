"""The one error type of bad carryover input (the CLI hook prints it as one line)."""

from __future__ import annotations


class CarryoverConfigError(ValueError):
    """A speculative config or drafter checkpoint that cannot work, with the fix."""
