"""Hand-written fakes for the Slurm seam (unit tests only; e2e tests use the real cluster)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuwarden.slurm.runner import CommandResult, CommandTimeoutError

Handler = Callable[[Sequence[str]], CommandResult]


def ok(argv: Sequence[str], stdout: str = "") -> CommandResult:
    return CommandResult(tuple(argv), 0, stdout, "")


def fail(argv: Sequence[str], stderr: str, rc: int = 1) -> CommandResult:
    return CommandResult(tuple(argv), rc, "", stderr)


@dataclass
class FakeRunner:
    """Answers commands from a queue of scripted results; records every call."""

    script: list[CommandResult | Exception | Handler] = field(default_factory=list)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.calls.append(tuple(argv))
        if not self.script:
            raise AssertionError(f"unexpected command {argv}")
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        if callable(step):
            return step(argv)
        return step


def node_json(name: str, state: Sequence[str], reason: str = "", by: str = "") -> str:
    return json.dumps({"nodes": [{
        "name": name, "state": list(state), "reason": reason, "reason_set_by_user": by,
        "reason_changed_at": {"set": True, "infinite": False, "number": 1795945000},
        "partitions": ["gpu"], "gres": "gpu:h100:8", "features": [],
    }]})


def timeout(argv: Sequence[str]) -> CommandTimeoutError:
    return CommandTimeoutError(argv, 30)
