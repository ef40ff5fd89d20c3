"""The Prometheus rules `install-files` ships (prometheus/gpuwarden.rules.yml): valid for
Prometheus, each alert unit-tested with series fed in (tests/promtool/*.test.yml: it fires when
it should and not before, nor for what it must leave alone), each with its runbook.

Skipped with the reason where promtool is not installed; a failure under CI=true
(`scripts/host-deps.sh promtool` installs it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.prom import CATALOGUE, REPO, RULES, UNIT_TESTS, metric_names, run

MONITORING = REPO / "docs" / "monitoring.md"


@dataclass(frozen=True)
class Rule:
    name: str  # the alert's name, or the recorded series'
    alert: bool
    lines: tuple[str, ...]  # the rule's block, as in the file

    @property
    def expr(self) -> str:
        return "\n".join(_block(self.lines, "expr"))

    def value(self, key: str) -> str:
        """A one-line key of the block (labels' and annotations' keys included), unquoted."""
        for line in self.lines:
            m = re.fullmatch(rf"\s*{key}: (.*)", line)
            if m:
                return m.group(1).strip('"')
        return ""


def _block(lines: tuple[str, ...], key: str) -> list[str]:
    """The value of ``key: |`` (or a one-line value): the lines indented under it."""
    for i, line in enumerate(lines):
        m = re.fullmatch(rf"(\s*){key}: (.*)", line)
        if m is None:
            continue
        if m.group(2) not in ("|", ">-"):
            return [m.group(2)]
        indent = len(m.group(1))
        out = []
        for more in lines[i + 1:]:
            if more.strip() and len(more) - len(more.lstrip()) <= indent:
                break
            out.append(more)
        return out
    return []


def rules(text: str) -> list[Rule]:
    """Every rule of a rules file written as this one is (one `- alert:` or `- record:` line
    opening each rule's block)."""
    found: list[Rule] = []
    lines = text.splitlines()
    starts = [(i, m) for i, line in enumerate(lines)
              if (m := re.fullmatch(r"\s*- (alert|record): (\S+)", line))]
    for n, (i, m) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
        block = lines[i:end]
        while block and (not block[-1].strip() or block[-1].strip() == "rules:"
                         or block[-1].lstrip().startswith("- name:")):
            block.pop()
        found.append(Rule(m.group(2), m.group(1) == "alert", tuple(block)))
    return found


ALERTS = [r for r in rules(RULES.read_text()) if r.alert]


def _failing_alerts(output: str) -> set[str]:
    return set(re.findall(r"alertname: (\w+), time:", output))


def test_promtool_accepts_the_rules() -> None:
    res = run("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules(RULES.read_text()))} rules found" in res.stdout


def test_every_alerts_unit_tests_pass() -> None:
    res = run("test", "rules", *map(str, UNIT_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") == len(UNIT_TESTS), res.stdout


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_waits(tmp_path: Path) -> None:
    """The unit tests mean it: firing nowhere fails each alert's firing case, and firing at
    once (no `for:`) fails each alert's case before its duration has passed."""
    text = RULES.read_text()
    silent, hasty = text, "\n".join(line for line in text.splitlines()
                                    if not re.fullmatch(r"\s*for: \S+", line))
    for alert in ALERTS:
        expr_line = next(line for line in alert.lines if line.lstrip().startswith("expr:"))
        block = "\n".join(alert.lines)
        never = block.replace("\n".join([expr_line, *_block(alert.lines, "expr")]),
                              expr_line.split("expr:")[0] + "expr: vector(0) > 1")
        silent = silent.replace(block, never)
    for mutant, why in ((silent, "never firing"), (hasty, "without for:")):
        rules_file = tmp_path / "gpuwarden" / "sitefiles" / "prometheus" / RULES.name
        rules_file.parent.mkdir(parents=True, exist_ok=True)
        rules_file.write_text(mutant)
        tests_dir = tmp_path / "tests" / "promtool"
        tests_dir.mkdir(parents=True, exist_ok=True)
        for t in UNIT_TESTS:
            (tests_dir / t.name).write_text(t.read_text())
        res = run("test", "rules", *(str(tests_dir / t.name) for t in UNIT_TESTS))
        assert res.returncode != 0, why
        out = res.stdout + res.stderr
        assert _failing_alerts(out) == {a.name for a in ALERTS}, (why, out)


def test_the_rules_read_only_catalogued_metrics() -> None:
    recorded = {r.name for r in rules(RULES.read_text()) if not r.alert}
    for rule in rules(RULES.read_text()):
        names = metric_names(rule.expr)
        assert names, rule.name
        assert names <= CATALOGUE | recorded, (rule.name, names - CATALOGUE - recorded)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a page."""
    out = set()
    for m in re.finditer(r"^#+ (.+)$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_alert_is_actionable_with_a_runbook() -> None:
    """A severity that routes it, a summary naming what, a description with the evidence, and a
    runbook section in docs/monitoring.md (what it means, what to run, when to escalate)."""
    doc = MONITORING.read_text()
    anchors = _anchors(doc)
    assert len(ALERTS) >= 9
    for alert in ALERTS:
        assert alert.value("severity") in ("critical", "warning"), alert.name
        assert alert.value("summary") and _block(alert.lines, "description"), alert.name
        url = alert.value("runbook_url")
        assert url == f"docs/monitoring.md#{alert.name.lower()}", alert.name
        assert alert.name.lower() in anchors, f"no runbook section for {alert.name}"
        section = doc.split(f"### {alert.name}\n", 1)[1].split("\n### ", 1)[0]
        for part in ("**What it means**", "**What to run**", "**Escalate**"):
            assert part in section, (alert.name, part)
        assert re.search(r"\bfor:\s*\d+[mh]\b", "\n".join(alert.lines)), alert.name
