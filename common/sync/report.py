"""Results of the sync checks: one named result per condition, one report per update."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

#: the seven conditions every weight synchronization must preserve (rl-anchors / the paper)
CONDITIONS = ("completeness", "byte_identity", "layout", "derived_state", "storage_stability",
              "atomic_versioning", "cache_coherence")


@dataclass
class CheckResult:
    name: str                       # one of CONDITIONS, or "probe"
    ok: Optional[bool]              # None: not run (says why in details)
    details: list = field(default_factory=list)
    cost_s: float = 0.0
    rank: Optional[int] = None

    def summary(self) -> str:
        state = "ok" if self.ok else ("skipped" if self.ok is None else "FAILED")
        head = f"{self.name}: {state} ({self.cost_s * 1e3:.1f} ms)"
        return head + ("" if self.ok or not self.details else " -- " + "; ".join(map(str, self.details[:5])))


@dataclass
class SyncReport:
    version: int
    applied: bool                   # the new weights are serving
    rolled_back: bool = False
    error: Optional[str] = None
    checks: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.applied and self.error is None and all(c.ok is not False for c in self.checks)

    def check(self, name: str) -> list:
        return [c for c in self.checks if c.name == name]

    def failed(self) -> list[str]:
        return sorted({c.name for c in self.checks if c.ok is False})

    def summary(self) -> str:
        lines = [f"weight version {self.version}: {'applied' if self.applied else 'NOT applied'}"
                 + (" (rolled back)" if self.rolled_back else "") + (f" -- {self.error}" if self.error else "")]
        lines += ["  " + c.summary() for c in self.checks]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SyncReport":
        d = dict(d)
        d["checks"] = [CheckResult(**c) for c in d.get("checks", [])]
        return cls(**d)
