"""What a job's submit command says about where it asked to run and what it ran. Pure.

sacct records the command line (`submit_line`, Slurm >= 21.08) but not the node request as a
field of its own (its `required` object holds CPUs and memory only). A job that named its
nodes (`-w c5,c9`, `--nodelist=c5`, `-F hosts`) chose them; its failures say little about
those nodes and a user can aim them, so the lemon detector discounts them. `#SBATCH -w` lines
inside the script are not in the command line and are not seen (the stored script, if any,
is not read).

The line is read as sbatch/srun/salloc's getopt_long reads it (src/common/slurm_opt.c): short
options bundle (`-vw c5` is -v -w c5, `-wc5` is -w c5), a long option may be any unique
prefix (`--nodel=c5`), an option that takes a value takes the next word whatever it looks
like (`-J -w` names the job "-w"), and the options end at the script or `--wrap`: what
follows is the job's, never sbatch's (`job.sh -w c5`, `--wrap echo -w c7`).
"""

from __future__ import annotations

import shlex

from gpuwarden.slurm.hostlist import HostlistError, expand

ALL_NODES = frozenset({"*"})  # -F/--nodefile: every node of the run was named
_PROGS = ("sbatch", "srun", "salloc")
# Short options that take a value (required: the rest of the word or the next word).
_SHORT_VALUE = frozenset("ABCDFGJLMNSTabcdeimnopqrtwx")
# Long options (sbatch, srun, salloc) and whether they take a required value; a long option
# with an optional value (`--wait`, `--exclusive`, ...) is listed as taking none: only
# `--opt=value` gives it one, as in getopt_long.
_LONG: dict[str, bool] = {
    **dict.fromkeys((
        "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "bcast", "chdir",
        "cluster-constraint", "clusters", "comment", "constraint", "container", "container-id",
        "core-spec", "cores-per-socket", "cpu-bind", "cpu-freq", "cpus-per-gpu",
        "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error",
        "exclude", "export-file", "extra", "extra-node-info", "gid", "gpu-bind", "gpu-freq",
        "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres", "gres-flags",
        "hint", "input", "job-name", "jobid", "kill-on-invalid-dep", "licenses",
        "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu",
        "mem-per-gpu", "mincpus", "network", "nice", "nodefile", "nodelist", "nodes",
        "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
        "ntasks-per-socket", "open-mode", "output", "partition", "power", "prefer",
        "priority", "profile", "propagate", "qos", "reservation", "resv-ports",
        "segment", "signal", "sockets-per-node", "switches", "thread-spec",
        "threads-per-core", "time", "time-min", "tmp", "tres-bind", "tres-per-task",
        "uid", "wckey", "wrap", "export", "het-group", "relative", "task-epilog",
        "task-prolog", "label", "kill-command", "multi-prog", "mpi", "epilog", "prolog",
        "immediate", "wait", "exclusive", "spread-job", "use-min-nodes", "requeue",
        "no-requeue", "overcommit", "oversubscribe", "contiguous", "hold", "help",
        "get-user-env", "ignore-pbs", "no-kill", "parsable", "quiet", "reboot", "test-only",
        "usage", "verbose", "version", "overlap", "pty", "unbuffered", "x11",
    ), True),
}
for _flag in ("batch", "immediate", "wait", "exclusive", "spread-job", "use-min-nodes",
              "requeue", "no-requeue", "overcommit", "oversubscribe", "contiguous", "hold",
              "help", "get-user-env", "ignore-pbs", "no-kill", "parsable", "quiet", "reboot",
              "test-only", "usage", "verbose", "version", "overlap", "pty", "unbuffered",
              "x11", "label", "multi-prog", "kill-on-invalid-dep", "propagate", "profile",
              "export-file"):
    _LONG[_flag] = _flag in ("kill-on-invalid-dep", "profile", "export-file")


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _long(word: str) -> tuple[str | None, str | None, bool]:
    """`--name[=value]`: (the option it abbreviates, the attached value, whether it takes
    one); None for an unknown or ambiguous prefix."""
    name, eq, value = word[2:].partition("=")
    if name in _LONG:
        return name, value if eq else None, _LONG[name]
    hits = [o for o in _LONG if o.startswith(name)] if name else []
    if len(hits) == 1:
        return hits[0], value if eq else None, _LONG[hits[0]]
    # Ambiguous or unknown: sbatch refuses the line, so it never ran; read it as a flag.
    return None, value if eq else None, False


def parse(line: str) -> tuple[frozenset[str], str]:
    """(nodes the command named, `ALL_NODES` for a node file; what the job ran)."""
    words = _words(line)
    if not words:
        return frozenset(), ""
    i = 1 if words[0].rsplit("/", 1)[-1] in _PROGS else 0
    lists: list[str] = []
    whole = False
    script = ""
    while i < len(words):
        w = words[i]
        i += 1
        if w == "--":
            script = " ".join(words[i:i + 1])
            break
        if w.startswith("--"):
            name, value, takes = _long(w)
            if takes and value is None and i < len(words):
                value = words[i]
                i += 1
            if name == "wrap":
                # sacct joins the words without their quotes: the rest of the line is the
                # command, and nothing in it is sbatch's.
                script = "wrap:" + " ".join([value or "", *words[i:]]).strip()
                break
            if name == "nodelist" and value:
                lists.append(value)
            elif name == "nodefile":
                whole = True
            continue
        if w.startswith("-") and len(w) >= 2:
            k = 1
            while k < len(w):
                c = w[k]
                k += 1
                if c in _SHORT_VALUE:
                    value = w[k:]
                    if not value and i < len(words):
                        value = words[i]
                        i += 1
                    if c == "w" and value:
                        lists.append(value.lstrip("="))
                    elif c == "F":
                        whole = True
                    break
            continue
        script = w  # the first word that is not an option: the script (srun: the program)
        break
    if whole:
        return ALL_NODES, script
    out: set[str] = set()
    for value in lists:
        try:
            out.update(expand(value))
        except HostlistError:
            return ALL_NODES, script  # a list we cannot read still named nodes
    return frozenset(out), script


def named_nodes(line: str) -> frozenset[str]:
    """Nodes the command asked for by name; `ALL_NODES` for a node file; empty for none."""
    return parse(line)[0]


def script_key(line: str) -> str:
    """What the job ran: the `--wrap` command or the batch script as given; "" when unknown."""
    return parse(line)[1]
