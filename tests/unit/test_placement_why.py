"""Users see why a gang job waits: the filter tells them at submit (slurm.log_user) and writes
the same line into the job's comment (squeue -O comment, scontrol show job), never over a
comment of their own; the Lua filter and decide.py agree word for word."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpuwarden.config.placement import PartitionPolicy
from gpuwarden.placement import snapshot
from gpuwarden.placement.decide import JobRequest, decide
from tests.unit.test_placement import DRIVER, filter_dir, lua, lua_job, lua_str, snap

# tests/lua/drive.lua, printing the comment too.
_FIELDS = '{ "req_switch", "wait4switch", "exc_nodes", "admin_comment" }'


def driver() -> str:
    text = DRIVER.read_text()
    assert _FIELDS in text
    return text.replace(_FIELDS, _FIELDS[:-2] + ', "comment" }')


def with_comment(job: JobRequest) -> str:
    text = lua_job(job)
    return text[:-2] + f", comment = {lua_str(job.comment)} }}" if job.comment else text


def run(tmp: Path, s: snapshot.Snapshot, cases: list[str]) -> list[dict[str, object]]:
    d = filter_dir(tmp)
    snap_file = d / "gpuwarden-placement.lua"
    snap_file.write_text(snapshot.render(s))
    snap_file.chmod(0o644)
    cases_file = tmp / "cases.lua"
    cases_file.write_text("slurm.reservations = {}\nreturn {\n" + ",\n".join(cases) + "\n}\n")
    out = subprocess.run([lua(), "-", str(d / "job_submit.lua"), str(snap_file),
                          str(cases_file)], input=driver(), capture_output=True, text=True,
                         timeout=30, check=True).stdout
    results: list[dict[str, object]] = []
    for line in out.splitlines():
        if line.startswith("case "):
            results.append({"logs": []})
        elif line.startswith("log "):
            results[-1]["logs"].append(line[4:])  # type: ignore[attr-defined]
        else:
            key, _, value = line.partition("=")
            results[-1][key] = value
    return results


def told(got: dict[str, object]) -> list[str]:
    return [x[6:] for x in got["logs"] if x.startswith("user: ")]  # type: ignore[attr-defined]


def test_a_job_held_for_one_leaf_is_told_why_and_its_comment_says_so(tmp_path: Path) -> None:
    s = snap()
    job = JobRequest(4, True)
    [got] = run(tmp_path, s, [with_comment(job)])
    want = decide(s, job)
    line = ("gpuwarden: this job may wait up to 300 s for 4 nodes under one leaf switch (fewer "
            "network hops), then runs wherever it fits; to start anywhere at once, submit with "
            "--switches=4")
    assert want.user_message == want.comment == line
    assert told(got) == [line] and got["comment"] == line
    assert got["req_switch"] == "1" and got["wait4switch"] == "300"


def test_the_users_own_comment_is_kept_and_they_are_told_where_to_look(tmp_path: Path) -> None:
    s = snap()
    job = JobRequest(6, True, comment="run 42, lr=3e-4")
    [got] = run(tmp_path, s, [with_comment(job)])
    want = decide(s, job)
    assert "comment" not in got and want.comment is None  # not changed
    assert told(got) == [want.user_message]
    assert want.user_message.startswith("gpuwarden: this job may wait up to 300 s for 6 nodes "
                                        "under 2 leaf switches")
    assert want.user_message.endswith("(your --comment is kept; the decision is in "
                                      "AdminComment: scontrol show job)")


def test_required_mode_names_slurms_cap_not_a_week(tmp_path: Path) -> None:
    s = snap(policy=PartitionPolicy(mode="required"))
    job = JobRequest(4, True)
    [got] = run(tmp_path, s, [with_comment(job)])
    assert told(got) == [decide(s, job).user_message] == [got["comment"]]
    assert "may wait as long as the cluster's max_switch_wait allows for 4 nodes" in str(
        got["comment"])


def test_nothing_is_said_where_nothing_is_held(tmp_path: Path) -> None:
    cases = [(snap(policy=PartitionPolicy(shadow=True)), JobRequest(4, True)),  # only logged
             (snap(policy=PartitionPolicy(wait_s=0)), JobRequest(4, True)),  # never waits
             (snap(), JobRequest(4, True, req_switch=2)),  # the user's own --switches
             (snap(), JobRequest(1, True))]  # not a gang job
    for s, job in cases:
        [got] = run(tmp_path, s, [with_comment(job)])
        want = decide(s, job)
        assert told(got) == [] and "comment" not in got, (job, got)
        assert want.user_message == "" and want.comment is None, job


def test_a_failed_write_tells_the_user_nothing_and_changes_nothing(tmp_path: Path) -> None:
    # All or nothing: a field Slurm refuses puts back the others, and the user is not told of
    # a wait the job does not carry.
    proxy = ("(function() local store = " + lua_job(JobRequest(4, True)) + "\n"
             "return setmetatable({}, { __index = store, __newindex = function(_, k, v)\n"
             "  if k == 'comment' and v ~= '' then error('comment refused') end\n"
             "  store[k] = v end }) end)()")
    [got] = run(tmp_path, snap(), [proxy])
    # Text fields go back to "" (Slurm's unset), numbers to what they were.
    assert {k: v for k, v in got.items() if k != "logs"} == {
        "exc_nodes": "", "admin_comment": "", "comment": ""}
    assert told(got) == []
    assert any("comment refused" in x and x.endswith("unchanged")
               for x in got["logs"])  # type: ignore[attr-defined]
