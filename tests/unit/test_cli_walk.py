"""Every `gpuwarden` verb, walked with bad input: no config file, an invalid one, no Slurm
commands to run, bad arguments, a job with no checkpoints. None may end in a traceback, and
every failure must say what to do next (the file or key to fix, the option to give, the
command to run). Run through the real entry point, in one subprocess (tests/unit/cliwalk.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]

# Slurm's entry points: walked for --help only here; a missing or broken config, and every
# failure inside, are theirs to fail open on (tests/unit/test_never_silently_off.py).
HOOKS = {("health", "prolog"), ("health", "epilog"), ("health", "periodic")}

# Per verb, the argument lists to try in every bad environment. A verb that is not listed
# (a new one) is walked with --help and an unknown option only: with no arguments it might
# start something long or install something as root.
ARGS: dict[tuple[str, ...], list[list[str]]] = {
    ("nodes",): [[], ["--json"]],
    ("drain",): [[], ["c1"], ["c1", "--reason", ""], ["c1", "--reason", "x"],
                 ["c1;x", "--reason", "y"]],
    ("resume",): [[], ["c1"]],
    ("config", "check"): [[], ["{tmp}/absent.toml"]],
    ("config", "show"): [[]],
    ("config", "set"): [[], ["cluster.nodes=4"], ["health.nope=1"], ["bogus"]],
    ("health", "check"): [["--gpus", "x"]],
    ("health", "show"): [[]],
    ("health", "selftest"): [[]],
    ("lemon", "list"): [[]],
    ("lemon", "scan"): [[], ["--since", "bogus"], ["--from", "{tmp}/absent"]],
    ("fleet", "mttf"): [[], ["--from", "{tmp}/absent"], ["--ckpt-cost", "x"],
                        ["--since", "0d"]],
    ("simulate",): [["--nodes", "-5"], ["--days", "0"]],  # without: a month of simulation
    ("slurm-conf",): [["--nodes", "0"], ["--part", "nosuch"]],
    ("placement", "daemon"): [["--once"]],
    ("placement", "explain"): [[], ["-N", "x"], ["-N", "4"], ["-N", "4", "--gpus-per-node",
                                                               "-1"]],
    ("ckpt", "ls"): [[], ["../etc"], ["job-1", "--rank", "x"], ["job-1"]],
    ("ckpt", "verify"): [[], ["job-1"], ["job-1", "--rank", "-1"]],
    ("ckpt", "gc"): [["job-1", "--keep", "0"], ["job-1"]],
    ("ckpt", "tidy"): [[]],
    ("ckpt", "interval"): [[], ["--gpus", "0"], ["--gpus", "8"],
                           ["--gpus", "8", "--mttf", "soon"]],
}

# What an error must contain to count as saying what to do next: the path or key to fix, a
# usage hint, a command to run, an option to give, or what is expected instead.
NEXT_STEP = ("--help", "give --", "run `", "set [", "pip install", "bin_dir",
             "health.check_timeout_s", "absent.toml", "`gpuwarden", "use ", "must ",
             "an integer from", "expected ")
# Known to say too little, in files this test's author could not change; reported to the lead
# (slurm/client.py check_node_name). Remove a line once its message says what to do.
KNOWN: set[tuple[str, ...]] = set()


def verbs() -> Iterator[tuple[str, ...]]:
    from gpuwarden.cli import cli

    def walk(cmd: click.Command, path: tuple[str, ...], ctx: click.Context
             ) -> Iterator[tuple[str, ...]]:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, name
                yield from walk(sub, (*path, name), click.Context(sub, ctx, info_name=name))
        else:
            yield path
    yield from walk(cli, (), click.Context(cli, info_name="gpuwarden"))


def environments(tmp: Path) -> dict[str, dict[str, str]]:
    """No config file; an invalid one; a valid one whose Slurm commands are not there (and
    whose every path is in ``tmp``: nothing outside it is read or written)."""
    for d in ("bin", "state", "shm", "fsx", "etc-slurm", "lemons"):
        (tmp / d).mkdir(mode=0o755)
    (tmp / "kmsg").write_text("")
    good = tmp / "gpuwarden.toml"
    good.write_text(f"""\
[slurm]
bin_dir = "{tmp}/bin"
command_timeout_s = 2.0
retries = 0
[health]
state_dir = "{tmp}/state"
gpu_probe = "fake"
fake_gpu_file = "{tmp}/gpus.json"
kernel_log = "{tmp}/kmsg"
[lemon]
list_file = "{tmp}/lemons/lemons.json"
[placement]
topology_file = "{tmp}/topology.conf"
snapshot_file = "{tmp}/etc-slurm/gpuwarden-placement.lua"
[ckpt]
memory_root = "{tmp}/shm/spool"
shared_root = "{tmp}/fsx/spool"
""")
    invalid = tmp / "invalid.toml"
    invalid.write_text('[health]\ncheck_timeout_s = "soon"\n')
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp)}
    return {name: {**base, "GPUWARDEN_CONFIG": str(path)} for name, path in
            (("absent", tmp / "absent.toml"), ("invalid", invalid), ("no-slurm", good))}


def walk_all(tmp: Path) -> list[dict[str, Any]]:
    cases = []
    for env_name, env in environments(tmp).items():
        for verb in verbs():
            arg_sets = [] if verb in HOOKS else ARGS.get(verb, [])
            if env_name == "no-slurm":  # what needs no environment, once
                arg_sets = [*arg_sets, ["--help"], ["--no-such-option"]]
            for args in arg_sets:
                argv = [*verb, *(a.replace("{tmp}", str(tmp)) for a in args)]
                cases.append({"argv": argv, "env": env, "where": env_name})
    # Run as a shell would: no terminal, no inherited GPUWARDEN_CONFIG.
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "unit" / "cliwalk.py")], cwd=tmp,
                          input="".join(json.dumps(c) + "\n" for c in cases),
                          capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stderr[-3000:]
    for case, res in zip(cases, results, strict=True):
        res["where"] = case["where"]
    return results


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return walk_all(tmp_path_factory.mktemp("walk"))


def show(res: dict[str, Any]) -> str:
    return f"[{res['where']}] gpuwarden {' '.join(map(str, res['argv']))} -> {res['code']}:\n" \
           f"{res['output']}{res['escaped']}"


def test_every_verb_is_walked(walked: list[dict[str, Any]]) -> None:
    seen = {tuple(r["argv"][:len(v)]) for r in walked for v in verbs()}
    missing = [" ".join(v) for v in verbs() if v not in seen]
    assert not missing, missing
    stale = [" ".join(v) for v in ARGS if v not in set(verbs())]
    assert not stale, f"ARGS names verbs that no longer exist: {stale}"


def test_no_verb_ends_in_a_traceback(walked: list[dict[str, Any]]) -> None:
    bad = [show(r) for r in walked if r["escaped"] or "Traceback" in str(r["output"])]
    assert not bad, "\n".join(bad)


def test_every_failure_says_what_to_do_next(walked: list[dict[str, Any]]) -> None:
    bad = [show(r) for r in walked if r["code"] not in (0, 3) and not any(
        hint in str(r["output"]) for hint in NEXT_STEP)
        and tuple(r["argv"]) not in KNOWN]
    assert not bad, "\n".join(bad)


def test_help_works_for_every_verb(walked: list[dict[str, Any]]) -> None:
    helps = [r for r in walked if r["argv"][-1] == "--help"]
    assert helps and all(r["code"] == 0 and "Usage: gpuwarden" in str(r["output"])
                         for r in helps), [show(r) for r in helps if r["code"] != 0]


@pytest.mark.parametrize("argv,where,needle", [
    # Regressions fixed with this test: each said nothing useful, or something untrue.
    (["ckpt", "interval", "--gpus", "8"], "no-slurm", "the accounting history cannot be read"),
    (["ckpt", "interval", "--gpus", "0"], "no-slurm", "'--gpus': 0 is not in the range"),
    (["ckpt", "verify", "job-1"], "no-slurm", "memory   no steps to verify"),
    (["ckpt", "verify", "job-1"], "no-slurm", "job-1 rank 0, memory tier on"),
    (["placement", "explain", "-N", "4"], "no-slurm", "set [placement] topology_file"),
    (["placement", "explain", "-N", "4", "--gpus-per-node", "-1"], "no-slurm",
     "'--gpus-per-node': -1 is not in the range"),
    (["nodes"], "absent", "absent.toml"),
    (["nodes"], "no-slurm", "bin_dir"),
])
def test_specific_messages(walked: list[dict[str, Any]], argv: list[str], where: str,
                           needle: str) -> None:
    [res] = [r for r in walked if r["argv"] == argv and r["where"] == where]
    assert needle in str(res["output"]), show(res)


@pytest.mark.parametrize("argv", [["drain", "c99", "--reason", "x"], ["resume", "c99"]])
def test_a_node_slurm_does_not_know_is_named_without_a_traceback(argv: list[str]) -> None:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config import Config
    from gpuwarden.config.context import Context
    from gpuwarden.slurm.client import CliSlurmClient
    from tests.fakes import FakeRunner, fail, ok

    # As Slurm 24.11 answers for a name it does not have: sinfo lists nothing, scontrol fails.
    runner = FakeRunner([ok(["sinfo"], '{"sinfo": []}'),
                         fail(["scontrol"], "Node c99 not found")])
    ctx = Context(client_factory=lambda cfg: CliSlurmClient(cfg.slurm, runner))
    ctx._config, ctx._from_file = Config(), True
    res = CliRunner().invoke(cli, argv, obj=ctx)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "c99" in res.output and "not found" in res.output and "Traceback" not in res.output
