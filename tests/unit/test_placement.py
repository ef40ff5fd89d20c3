"""Placement: topology.conf, the snapshot, the decision, and the Lua filter itself (lua5.1)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.placement import snapshot
from gpuwarden.placement.decide import JobRequest, decide
from gpuwarden.slurm import topology
from gpuwarden.slurm.models import Node
from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parents[2]
FILTER = ROOT / "plugins" / "job_submit.lua"
DRIVER = ROOT / "tests" / "lua" / "drive.lua"
NO_VAL = 4294967294

TREE = """\
# --- gpuwarden: topology/tree ---
SwitchName=leaf1 Nodes=c[1-4]
SwitchName=leaf2 Nodes=c[5-8]
SwitchName=spine Switches=leaf[1-2]
"""


def node(name: str, state: tuple[str, ...] = ("IDLE",), reason: str = "",
         comment: str = "") -> Node:
    return Node(name, state, reason, "", None, ("gpu",), "gpu:h100:8", (), None, comment)


def snap(nodes: list[Node] | None = None, lemons: tuple[str, ...] = (),
         policy: PartitionPolicy | None = None, now: float | None = None) -> snapshot.Snapshot:
    cfg = PlacementConfig(default=policy or PartitionPolicy())
    nodes = nodes or [node(f"c{i}") for i in range(1, 9)]
    return snapshot.build(cfg, topology.parse(TREE), nodes,
                          {"gpu": tuple(n.name for n in nodes)}, lemons, 7,
                          now if now is not None else time.time())


# ---- topology.conf ---------------------------------------------------------------------------
def test_tree_and_block_topologies_parse_into_leaves() -> None:
    t = topology.parse(TREE)
    assert t.kind == "tree" and [(x.name, len(x.nodes)) for x in t.leaves] == [("leaf1", 4),
                                                                               ("leaf2", 4)]
    b = topology.parse("BlockName=b1 Nodes=n[01-18]\nBlockName=b2 Nodes=n[19-36]\n"
                       "BlockSizes=18,36\n")
    assert b.kind == "block" and b.block_sizes == (18, 36) and len(b.leaves[1].nodes) == 18


def test_the_template_topology_is_what_the_parser_reads() -> None:
    from gpuwarden.config import Config
    from gpuwarden.slurmconf.render import render

    text = render("topology.conf", Config().cluster)
    assert [len(x.nodes) for x in topology.parse(text).leaves] == [4, 4]


@pytest.mark.parametrize("text,needle", [
    ("SwitchName=leaf1 Nodes=c[1-4\n", "topology.conf:1: Nodes=:"),
    ("SwitchName=a Nodes=c1\nSwitchName=b Nodes=c1\n", "topology.conf:2: node c1 is already under a"),
    ("SwitchName=a Nodes=c1\nSwitchName=a Nodes=c2\n", "topology.conf:2: a is already defined on line 1"),
    ("SwitchName=a Nodes=c1\n\nfoo bar\n", "topology.conf:3: expected Key=Value fields only"),
    ("SwitchName=a\n", "topology.conf:1: a switch needs Nodes="),
    ("SwitchName=a Nodes=c1\nBlockName=b Nodes=c2\n", "mixes SwitchName="),
    ("# nothing\n", "no leaf switches or blocks"),
])
def test_bad_topology_lines_name_the_line(text: str, needle: str) -> None:
    with pytest.raises(topology.TopologyError) as err:
        topology.parse(text)
    assert needle in str(err.value)


# ---- snapshot and decision -------------------------------------------------------------------
def test_snapshot_counts_healthy_nodes_per_leaf_and_lists_suspects() -> None:
    nodes = [node(f"c{i}") for i in range(1, 9)]
    nodes[2] = node("c3", ("IDLE", "DRAIN"), "gpuwarden: xid 79")  # Slurm avoids it already
    nodes[1] = node("c2", comment="gpuwarden: would drain: ecc (blast-radius cap)")
    s = snap(nodes, lemons=("c6",))
    v = s.partitions["gpu"]
    assert v.capacity == (3, 2) and v.healthy == 5  # leaf2 loses c6, leaf1 c2 and c3
    assert v.exclude == ("c2", "c6") and s.why["c6"] == "lemon"
    assert s.default_partition == "gpu"


def test_decisions() -> None:
    s = snap()
    d = decide(s, JobRequest(4, True))
    assert (d.action, d.switches, d.wait_s, d.exc_nodes) == ("place", 1, 300, None)
    assert decide(s, JobRequest(6, True)).switches == 2
    assert decide(s, JobRequest(1, True)).action == "pass"  # not a gang job
    assert decide(s, JobRequest(4, False)).action == "pass"  # no GPUs
    assert decide(s, JobRequest(4, True, req_switch=2)).switches is None  # the user's kept
    assert decide(s, JobRequest(4, True, partition="cpu")).action == "pass"
    req = decide(snap(policy=PartitionPolicy(mode="required")), JobRequest(4, True))
    assert req.wait_s == 7 * 86_400
    lem = decide(snap(lemons=("c6",)), JobRequest(2, True, exc_nodes="c1"))
    assert lem.exc_nodes == "c1,c6"
    named = decide(snap(lemons=("c6",)), JobRequest(2, True, req_nodes="c5,c6"))
    assert named.exc_nodes is None and named.switches is None  # --nodelist kept as asked
    big = decide(snap(lemons=("c6",)), JobRequest(8, True))
    assert big.switches is None and big.exc_nodes is None and "7 healthy" in big.user_message


def test_snapshot_renders_to_data_lines_with_a_generation_header() -> None:
    text = snapshot.render(snap(lemons=("c6",)))
    first = text.splitlines()[0]
    assert first.startswith("-- gpuwarden placement snapshot generation 7 written ")
    assert "capacity=4,3\navoid gpu keep=7 nodes=c6\n" in text and text.endswith("\nend\n")


def test_a_name_the_filter_could_not_read_back_is_refused_at_render() -> None:
    s = snap()
    bad = replace(s, partitions={"gpu x": replace(s.partitions["gpu"], name="gpu x")})
    with pytest.raises(snapshot.SnapshotError, match="partition 'gpu x' cannot be written"):
        snapshot.render(bad)


# ---- the Lua filter itself -------------------------------------------------------------------
def lua() -> str:
    exe = shutil.which("lua5.1")
    if exe is None:
        if in_ci():
            pytest.fail("lua5.1 is missing (apt-get install lua5.1): job_submit.lua is untested")
        pytest.skip("lua5.1 is not installed (apt-get install lua5.1)")
    return exe


def lua_str(v: str) -> str:
    """A Lua string literal for ``v`` (tabs and newlines included)."""
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
        .replace("\t", "\\t") + '"'


def lua_job(j: JobRequest) -> str:
    fields = [f"min_nodes = {j.min_nodes}", f"req_switch = {j.req_switch or NO_VAL}",
              f"wait4switch = {NO_VAL}", f"contiguous = {1 if j.contiguous else 0}",
              f"max_nodes = {NO_VAL if j.max_nodes is None else j.max_nodes}",
              f"num_tasks = {j.tasks or NO_VAL}"]
    if j.gpus and (j.gpus_per_node or not j.gpus_per_job):
        fields.append(f'tres_per_node = "gres/gpu:{j.gpus_per_node or 8}"')
    if j.gpus_per_job:
        fields.append(f'tres_per_job = "gres/gpu:{j.gpus_per_job}"')
    if j.partition:
        fields.append(f'partition = "{j.partition}"')
    if j.req_nodes:
        fields.append(f'req_nodes = "{j.req_nodes}"')
    if j.exc_nodes:
        fields.append(f"exc_nodes = {lua_str(j.exc_nodes)}")
    if j.reservation:
        fields.append(f'reservation = "{j.reservation}"')
    if j.deferred:
        fields.append('dependency = "afterok:1"')
    return "{ " + ", ".join(fields) + " }"


def filter_dir(tmp: Path) -> Path:
    """A directory like slurm.conf's: job_submit.lua and its snapshot side by side."""
    d = tmp / "etc-slurm"
    d.mkdir(mode=0o755, exist_ok=True)
    shutil.copy(FILTER, d / "job_submit.lua")
    return d


def cases_lua(jobs: list[JobRequest], reservations: str = "{}",
              extra: str = "") -> str:
    """The driver's cases file; ``reservations``: slurm.reservations as slurmctld sets it;
    ``extra``: more job_desc fields for every job ("begin_time = 5, ")."""
    return (f"slurm.reservations = {reservations}\n"
            "return {\n" + ",\n".join(lua_job(j).replace("{ ", "{ " + extra, 1)
                                      for j in jobs) + "\n}\n")


def run_filter(tmp: Path, snapshot_text: str | None, jobs: list[JobRequest],
               lfs: bool = True, snap_file: Path | None = None,
               timeout: float = 30, reservations: str = "{}",
               cwd: Path | None = None, now: int | None = None,
               extra: str = "") -> list[dict[str, object]]:
    d = filter_dir(tmp)
    snap_file = snap_file or d / "gpuwarden-placement.lua"
    if snapshot_text is not None:
        snap_file.write_text(snapshot_text)
        snap_file.chmod(0o644)
    cases = tmp / "cases.lua"
    cases.write_text(cases_lua(jobs, reservations, extra))
    pre = [] if lfs else ["-e", "gpuwarden_no_lfs = true"]
    if now is not None:  # the filter's clock, for the waits it derives from the snapshot
        pre += ["-e", f"os.time = function() return {now} end"]
    # The driver comes on stdin, so the outermost file on the Lua stack is job_submit.lua, as
    # when slurmctld loads it: its directory is where the filter looks for the snapshot.
    out = subprocess.run([lua(), *pre, "-", str(d / "job_submit.lua"), str(snap_file),
                          str(cases)], stdin=DRIVER.open(), capture_output=True, text=True,
                         timeout=timeout, check=True, cwd=cwd).stdout
    results: list[dict[str, object]] = []
    for line in out.splitlines():
        if line.startswith("case "):
            results.append({"rc": line.split("rc=")[1], "logs": []})
        elif line.startswith("log "):
            results[-1]["logs"].append(line[4:])  # type: ignore[attr-defined]
        else:
            key, _, value = line.partition("=")
            results[-1][key] = value
    return results


CASES = [
    JobRequest(4, True), JobRequest(6, True), JobRequest(1, True), JobRequest(4, False),
    JobRequest(4, True, req_switch=2), JobRequest(2, True, exc_nodes="c1"),
    JobRequest(2, True, req_nodes="c5,c6"), JobRequest(8, True), JobRequest(3, True,
                                                                           contiguous=True),
    JobRequest(4, True, partition="cpu"), JobRequest(4, True, partition="gpu,cpu"),
    JobRequest(2, True, reservation="r1"), JobRequest(6, True, exc_nodes="c[1-2]"),
    JobRequest(5, True, exc_nodes="c[1-2]"), JobRequest(2, True, exc_nodes="c[1-"),
]


def test_the_lua_filter_decides_as_the_python_reference(tmp_path: Path) -> None:
    s = snap(lemons=("c6",))
    results = run_filter(tmp_path, snapshot.render(s), CASES)
    assert len(results) == len(CASES)
    for job, got in zip(CASES, results, strict=True):
        want = decide(s, job)
        assert got["rc"] == "0"
        if want.action == "pass":
            assert set(got) == {"rc", "logs"}, (job, got)
            continue
        assert got.get("req_switch") == (str(want.switches) if want.switches else None), job
        assert got.get("wait4switch") == (str(want.wait_s) if want.wait_s else None), job
        assert got.get("exc_nodes") == want.exc_nodes, job
        assert got["admin_comment"] == f"gpuwarden placement (snapshot 7): {want.why}", job
    assert any("user: gpuwarden: this job asks for 8 nodes" in x
               for x in results[7]["logs"])  # type: ignore[attr-defined]


def test_shadow_mode_logs_the_decision_and_changes_nothing(tmp_path: Path) -> None:
    s = snap(policy=PartitionPolicy(shadow=True))
    [got] = run_filter(tmp_path, snapshot.render(s), [JobRequest(4, True)])
    assert set(got) == {"rc", "logs"}
    assert got["logs"] == ["info: gpuwarden placement (shadow): job from uid 1000: would set "
                           "switches=1 wait=300s"]


def head(t: str) -> str:
    return t.splitlines()[0]


@pytest.mark.parametrize("mangle,needle", [
    (lambda t: None, "missing"),
    (lambda t: "garbage {{{\n", "no generation line"),
    (lambda t: head(t) + "\nreturn {{{\n", "cannot parse"),
    (lambda t: head(t) + "\nreturn 42\nend\n", "cannot parse: line 2: not a comment line"),
    (lambda t: head(t) + "\n-- x\nreturn {version = 1}\nend\n", "not a format 4 snapshot"),
    (lambda t: t.replace("capacity=4,3", "capacity=x"), "line 7: not a valid partition line"),
    (lambda t: t.replace("capacity=4,3", "capacity=4,,3"), "capacity is not a list"),
    (lambda t: t.replace("avoid gpu", "avoid cpu"), "not a valid avoid line"),
    (lambda t: t.replace("\nend\n", "\n"), "incomplete (no end line)"),
    (lambda t: t.replace("kind tree\n", ""), "kind or default_partition is missing"),
    (lambda t: t.replace("\nend\n", "\nos.exit(3)\nend\n"), "not a snapshot record"),
    (lambda t: head(t) + "\nwhile true do end\n", "cannot parse"),
    (lambda t: head(t) + '\nreturn ("x"):rep(2^31)\n', "cannot parse"),
    (lambda t: head(t) + "\n--" + "x" * (9 << 20) + "\n", "too large"),
])
def test_any_snapshot_problem_lets_the_job_through_unchanged(tmp_path: Path, mangle, needle) -> None:  # type: ignore[no-untyped-def]
    text = mangle(snapshot.render(snap(lemons=("c6",))))
    [got] = run_filter(tmp_path, text, [JobRequest(4, True)])
    assert set(got) == {"rc", "logs"} and got["rc"] == "0"
    assert len(got["logs"]) == 1 and needle in got["logs"][0]  # type: ignore[arg-type,index]
    assert got["logs"][0].endswith("job from uid 1000 unchanged")  # type: ignore[index]


def test_a_stale_snapshot_lets_the_job_through(tmp_path: Path) -> None:
    s = replace(snap(now=time.time() - 600))
    [got] = run_filter(tmp_path, snapshot.render(s), [JobRequest(4, True)])
    assert set(got) == {"rc", "logs"}
    assert "stale: written 6" in got["logs"][0]  # type: ignore[index]


# ---- the daemon ------------------------------------------------------------------------------
def daemon_setup(tmp_path: Path) -> tuple[PlacementConfig, object, str]:
    from tests.fakes import FakeSlurm

    class Slurm(FakeSlurm):
        def partitions(self) -> dict[str, tuple[str, ...]]:
            return {"gpu": tuple(self.table)}

    topo = tmp_path / "topology.conf"
    topo.write_text(TREE)
    cfg = PlacementConfig(topology_file=str(topo), snapshot_file=str(tmp_path / "snap.lua"),
                          interval_s=1, stale_after_s=10)
    slurm = Slurm({f"c{i}": node(f"c{i}") for i in range(1, 9)})
    return cfg, slurm, str(tmp_path / "no-lemons.json")


def test_the_daemon_writes_and_bumps_the_generation_only_on_change(tmp_path: Path) -> None:
    from gpuwarden.placement import daemon

    cfg, slurm, lemons = daemon_setup(tmp_path)
    state = daemon.State()
    first = daemon.step(cfg, slurm, lemons, state, 1000.0)  # type: ignore[arg-type]
    assert first is not None and first.partitions["gpu"].capacity == (4, 4)
    again = daemon.step(cfg, slurm, lemons, state, 1005.0)  # type: ignore[arg-type]
    assert again is not None and again.generation == first.generation
    header = Path(cfg.snapshot_file).read_text().splitlines()[0]
    assert header.endswith(f"generation {first.generation} written 1005")
    slurm.table["c2"] = node("c2", comment="gpuwarden: would drain: ecc")  # type: ignore[attr-defined]
    changed = daemon.step(cfg, slurm, lemons, state, 1010.0)  # type: ignore[arg-type]
    assert changed is not None and changed.generation > first.generation


def test_a_bad_topology_keeps_the_last_good_snapshot(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from gpuwarden.placement import daemon

    cfg, slurm, lemons = daemon_setup(tmp_path)
    state = daemon.State()
    daemon.step(cfg, slurm, lemons, state, 1000.0)  # type: ignore[arg-type]
    good = Path(cfg.snapshot_file).read_text()
    Path(cfg.topology_file).write_text(TREE + "SwitchName=leaf3 Nodes=c[9-\n")
    assert daemon.step(cfg, slurm, lemons, state, 1005.0) is None  # type: ignore[arg-type]
    assert Path(cfg.snapshot_file).read_text() == good
    assert "topology.conf:5: Nodes=" in caplog.text and "last good one stays" in caplog.text


def test_a_drained_lemon_back_in_service_was_repaired_and_is_no_suspect() -> None:
    nodes = [node("c5"), node("c6"), node("c7", ("IDLE", "DRAIN"), "gpuwarden: lemon, x")]
    got = snapshot.suspects(nodes, {"c5": "held", "c6": "drained", "c7": "drained"})
    assert got == {"c5": "lemon"}


# ---- cli_filter.lua (--segment on topology/block) --------------------------------------------
CLI_FILTER = ROOT / "plugins" / "cli_filter.lua"


def run_cli_filter(tmp: Path, topo_text: str | None, options: dict[str, str]) -> dict[str, str]:
    topo = tmp / "topology.conf"
    if topo_text is not None:
        topo.write_text(topo_text)
    opts = ", ".join(f'["{k}"] = "{v}"' for k, v in options.items())
    script = (f'gpuwarden_topology_path = "{topo}"\n'
              'slurm = { SUCCESS = 0, log_debug = function() end }\n'
              f'dofile("{CLI_FILTER}")\n'
              f"local o = {{ {opts} }}\n"
              "assert(slurm_cli_pre_submit(o, 0) == 0)\n"
              "for k, v in pairs(o) do print(k .. '=' .. v) end\n")
    out = subprocess.run([lua(), "-"], input=script, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


BLOCKS = "BlockName=b1 Nodes=n[01-18]\nBlockName=b2 Nodes=n[19-36]\nBlockSizes=18,36\n"


@pytest.mark.parametrize("options,segment", [
    ({"nodes": "36", "gpus-per-node": "8"}, "18"),
    ({"nodes": "12", "gpus-per-node": "8"}, None),  # fits in one block: left to Slurm
    ({"nodes": "36", "gpus-per-node": "8", "segment": "unset"}, "18"),  # Slurm's "unset"
    ({"nodes": "20", "gres": "gpu:8"}, "10"),  # the largest divisor that fits in a block
    ({"nodes": "36"}, None),  # no GPUs: not a gang job
    ({"nodes": "1", "gpus": "8"}, None),
    ({"nodes": "36", "gpus": "288", "segment": "9"}, "9"),  # the user's own
])
def test_cli_filter_sets_segment_on_block_topologies(tmp_path: Path, options: dict[str, str],
                                                     segment: str | None) -> None:
    assert run_cli_filter(tmp_path, BLOCKS, options).get("segment") == segment


def test_cli_filter_leaves_tree_topologies_and_missing_files_alone(tmp_path: Path) -> None:
    opts = {"nodes": "4", "gpus-per-node": "8"}
    assert "segment" not in run_cli_filter(tmp_path, TREE, opts)
    assert "segment" not in run_cli_filter(tmp_path, None, opts)
