"""Verify results: problems (the store breaks its spec: verify fails) apart from warnings (something
verify could not check: reported, never a failure).

A format's `verify(path)` returns one string per finding; a warning is marked by starting with
WARNING_PREFIX (`warning("...")` builds one), everything else is a problem. `VerifyReport`
separates the two; `actlake.verify` returns the problems only, so "empty list: valid" holds for
every caller, and `actlake.verify_report` returns both. Recorded in docs/formats.md ("Checks").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: the mark of a warning among a format's verify findings
WARNING_PREFIX = "warning: "


class VerifyWarning(UserWarning):
    """A verify finding that does not fail the store: something verify could not check, named."""


def warning(message: str) -> str:
    """A verify finding that is a warning, not a problem."""
    return WARNING_PREFIX + message


def is_warning(finding: str) -> bool:
    """Whether a verify finding is a warning (marked with WARNING_PREFIX)."""
    return finding.startswith(WARNING_PREFIX)


@dataclass(frozen=True)
class VerifyReport:
    """What verify found: `problems` fail the store; `warnings` (unmarked text) name what was not checked."""

    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No problems (warnings do not count)."""
        return not self.problems

    @classmethod
    def from_findings(cls, findings: Iterable[str], *, prefix: str = "") -> VerifyReport:
        """Split a format's findings; `prefix` (e.g. the slice a finding belongs to) goes before each message."""
        problems: list[str] = []
        warnings: list[str] = []
        for finding in findings:
            if is_warning(finding):
                warnings.append(prefix + finding[len(WARNING_PREFIX):])
            else:
                problems.append(prefix + finding)
        return cls(tuple(problems), tuple(warnings))

    def __add__(self, other: VerifyReport) -> VerifyReport:
        return VerifyReport(self.problems + other.problems, self.warnings + other.warnings)


__all__ = ["WARNING_PREFIX", "VerifyReport", "VerifyWarning", "is_warning", "warning"]
