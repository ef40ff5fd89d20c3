"""What a job's submit command says about where it asked to run and what it ran. Pure.

sacct records the command line (`submit_line`, Slurm >= 21.08) but not the node request as a
field of its own (its `required` object holds CPUs and memory only). A job that named its
nodes (`-w c5,c9`, `--nodelist=c5`, `-F hosts`) chose them; its failures say little about
those nodes and a user can aim them, so the lemon detector discounts them. `#SBATCH -w` lines
inside the script are not in the command line and are not seen (the stored script, if any,
is not read).
"""

from __future__ import annotations

import shlex

from gpuwarden.slurm.hostlist import HostlistError, expand

ALL_NODES = frozenset({"*"})  # -F/--nodefile: every node of the run was named
_PROGS = ("sbatch", "srun", "salloc")
# Options that take a value as the next word (so that the value is not taken for the script).
_WITH_VALUE = frozenset("ABDFJLMacdeiklmnopqstuwx")
_LONG_WITH_VALUE = frozenset({
    "--account", "--array", "--chdir", "--constraint", "--cpus-per-task", "--dependency",
    "--error", "--exclude", "--export", "--gpus", "--gpus-per-node", "--gres", "--input",
    "--job-name", "--mem", "--mem-per-cpu", "--mem-per-gpu", "--nodefile", "--nodelist",
    "--nodes", "--ntasks", "--ntasks-per-node", "--output", "--partition", "--qos",
    "--reservation", "--time", "--time-min", "--wckey",
})


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def named_nodes(line: str) -> frozenset[str]:
    """Nodes the command asked for by name; `ALL_NODES` for a node file; empty for none."""
    words = _words(line)
    out: set[str] = set()
    for i, w in enumerate(words):
        value = None
        if w in ("-w", "--nodelist") and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith("--nodelist="):
            value = w.split("=", 1)[1]
        elif w.startswith("-w") and len(w) > 2 and not w.startswith("--"):
            value = w[2:].lstrip("=")
        elif w in ("-F", "--nodefile") or (w.startswith(("--nodefile=", "-F")) and len(w) > 2):
            return ALL_NODES
        if value:
            try:
                out.update(expand(value))
            except HostlistError:
                return ALL_NODES  # a list we cannot read still named nodes
    return frozenset(out)


def script_key(line: str) -> str:
    """What the job ran: the `--wrap` command or the batch script as given; "" when unknown."""
    words = _words(line)
    if not words:
        return ""
    i = 1 if words[0].rsplit("/", 1)[-1] in _PROGS else 0
    while i < len(words):
        w = words[i]
        if w == "--wrap" and i + 1 < len(words):
            # sacct joins the words without their quotes: the rest of the line is the command.
            return "wrap:" + " ".join(words[i + 1:])
        if w.startswith("--wrap="):
            # The same: sacct's line has lost the quotes around the command.
            return "wrap:" + " ".join([w.split("=", 1)[1], *words[i + 1:]])
        if w == "--":
            return " ".join(words[i + 1:i + 2])
        if w.startswith("--"):
            i += 2 if w in _LONG_WITH_VALUE else 1
            continue
        if w.startswith("-") and len(w) >= 2:
            i += 2 if len(w) == 2 and w[1] in _WITH_VALUE else 1
            continue
        return w  # the first word that is not an option: the script (srun: the program)
    return ""
