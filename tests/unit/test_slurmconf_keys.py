"""`slurm-conf --check` and the keys Slurm knows: a key the running release does not know stops
slurmctld, so a typo or a newer release's key is a conflict, not "ok"."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm.runner import CommandResult
from gpuwarden.slurmconf import check, keys
from tests.unit.test_slurmconf_check import conf_dir, finding, run


def test_a_misspelt_key_is_a_conflict_that_names_the_right_one(tmp_path: Path) -> None:
    code, out = run(conf_dir(tmp_path, "PrologEpilogTimout=300\n"), ["lemon"], version=(24, 11))
    assert code == 1
    line = finding(out, "PrologEpilogTimout")
    assert line.startswith("conflict") and "unrecognized key" in line
    assert line.endswith("-> did you mean PrologEpilogTimeout? correct or remove it")


def test_keys_are_case_insensitive_as_in_slurm(tmp_path: Path) -> None:
    code, out = run(conf_dir(tmp_path, "accountingstoragetype=accounting_storage/slurmdbd\n"
                                       "PROLOGEPILOGTIMEOUT=300\n"), ["lemon"], version=(24, 11))
    assert code == 0, out


@pytest.mark.parametrize(("version", "verdict"), [
    ((24, 11), "needs Slurm >= 25.05, this is 24.11"),
    (None, "needs Slurm >= 25.05: an older slurmctld stops at it"),
    ((25, 5), ""),
    ((26, 5), ""),
])
def test_a_key_of_a_newer_release_is_judged_by_the_release_at_hand(
        tmp_path: Path, version: tuple[int, int] | None, verdict: str) -> None:
    path = conf_dir(tmp_path, "AccountingStorageType=accounting_storage/slurmdbd\n"
                              "PrologTimeout=400\n")
    code, out = run(path, ["lemon"], version=version)
    hits = [line for line in out[1:-1] if "PrologTimeout" in line]
    if not verdict:
        assert code == 0 and hits == [], out
        return
    assert code == 1 and len(hits) == 1 and verdict in hits[0], out
    if version is None:
        assert hits[0].endswith("-> pass --slurm-version (or run this where scontrol is) to "
                                "check it against yours")


def test_a_key_removed_since_is_a_conflict_on_the_newer_release(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "AccountingStorageType=accounting_storage/slurmdbd\n"
                              "AccountingStorageLoc=/var/log/slurm/acct\n")
    assert run(path, ["lemon"], version=(25, 5))[0] == 0
    code, out = run(path, ["lemon"], version=(25, 11))
    assert code == 1
    assert "was removed in Slurm 25.11, this is 25.11" in finding(out, "AccountingStorageLoc was")


def test_the_header_says_which_release_the_keys_were_checked_against(tmp_path: Path) -> None:
    path = conf_dir(tmp_path, "ClusterName=c\n")
    assert run(path, ["lemon"], version=(25, 11))[1][0].endswith("against Slurm 25.11 (test)")
    assert "unknown release" in run(path, ["lemon"])[1][0]


def test_every_key_gpuwarden_writes_is_known_to_every_release() -> None:
    for line in check.block().splitlines():
        key = line.lstrip("#").split("=", 1)[0]
        if "=" in line and " " not in key:
            for release in keys.RELEASES:
                assert keys.judge_key(key, release) is None, (key, release)


def test_the_lists_follow_slurms_releases() -> None:
    # Spot checks against read_config.c of each release.
    assert keys.SPANS["prologtimeout"].since == (25, 5)
    assert keys.SPANS["frontendname"].until == (25, 5)
    assert keys.SPANS["healthchecktimeout"].since == (26, 5)
    assert keys.SPANS["nodename"].since == keys.OLDEST and keys.SPANS["nodename"].until is None
    # A release between the listed ones has the keys of the one before it; an older one is
    # judged by the oldest list.
    assert keys.release_for((25, 8)) == (25, 5) and keys.release_for((23, 11)) == (24, 5)
    assert keys.release_for((24, 11)) == (24, 11)


@pytest.mark.parametrize(("text", "version"), [
    ("slurm 24.11.7\n", (24, 11)), ("slurm-wlm 25.05.2\n", (25, 5)),
    ("slurm 26.05.0-0rc1\n", (26, 5)), ("no version here\n", None),
])
def test_the_running_release_comes_from_scontrol_version(
        text: str, version: tuple[int, int] | None) -> None:
    class Runner:
        def run(self, argv: list[str], timeout: float) -> CommandResult:
            assert argv == ["scontrol", "--version"] and timeout <= 30
            return CommandResult(tuple(argv), 0, text, "")

    assert check.running_version(Runner()) == version


def test_no_scontrol_means_an_unknown_release() -> None:
    class Missing:
        def run(self, argv: list[str], timeout: float) -> CommandResult:
            raise SlurmError("scontrol not found")

    assert check.running_version(Missing()) is None


@pytest.mark.parametrize(("text", "version"), [
    ("24.11", (24, 11)), ("25.05.2", (25, 5)), (" 26.05 ", (26, 5)),
    ("24", None), ("slurm 24.11", None), ("24.11;rm", None),
])
def test_a_release_as_a_user_names_it(text: str, version: tuple[int, int] | None) -> None:
    assert keys.parse_release(text) == version


def test_24_05_is_judged_by_its_own_keys() -> None:
    """24.11 added DataParserParameters and Certmgr*: a 24.05 slurmctld stops at them."""
    why = keys.judge_key("DataParserParameters", (24, 5))
    assert why is not None and "needs Slurm >= 24.11, this is 24.05" in why[0]
    assert keys.judge_key("DataParserParameters", (24, 11)) is None
    assert keys.judge_key("HashPlugin", (24, 5)) is None
