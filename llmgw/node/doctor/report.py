"""What ``llmgw doctor`` concluded: findings (most serious first) and the facts they rest on."""

from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping

import attrs


class Severity(str, enum.Enum):
    """How bad a finding is. FAIL: this node cannot run (some) engines; WARN: it runs worse
    or risks it; OK: checked and fine; INFO: a fact worth saying, not a judgement."""

    FAIL = "fail"
    WARN = "warn"
    OK = "ok"
    INFO = "info"

    @property
    def rank(self) -> int:
        """0 for the most serious."""
        return _RANKS[self]


_RANKS = {Severity.FAIL: 0, Severity.WARN: 1, Severity.INFO: 2, Severity.OK: 3}


@attrs.frozen
class Finding:
    """One conclusion: what ``topic`` it is about, what was found, and what to do (``fix``, "" for none)."""

    severity: Severity
    topic: str
    message: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"severity": self.severity.value, "topic": self.topic, "message": self.message, "fix": self.fix}


@attrs.frozen
class Report:
    """Every finding, most serious first (then by topic, in the order checked), and the facts behind them."""

    findings: tuple[Finding, ...]
    facts: Mapping[str, Any]

    @classmethod
    def of(cls, findings: Iterable[Finding], facts: Mapping[str, Any]) -> Report:
        ordered = sorted(enumerate(findings), key=lambda pair: (pair[1].severity.rank, pair[0]))
        return cls(tuple(f for _, f in ordered), dict(facts))

    @property
    def failed(self) -> bool:
        """Whether anything failed (``llmgw doctor`` then exits non-zero)."""
        return any(f.severity is Severity.FAIL for f in self.findings)

    def counts(self) -> tuple[int, int]:
        """Returns how many findings failed and how many warn."""
        return (sum(f.severity is Severity.FAIL for f in self.findings),
                sum(f.severity is Severity.WARN for f in self.findings))

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.failed, "findings": [f.to_json() for f in self.findings], "facts": dict(self.facts)}
