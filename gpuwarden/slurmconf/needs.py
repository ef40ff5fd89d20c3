"""What each gpuwarden feature needs in slurm.conf: the one list that both the merged block
(`gpuwarden slurm-conf --part gpuwarden`, quoted by the admin guide) and the check
(`gpuwarden slurm-conf --check`) are made from. Pure.

Facts behind the rules (Slurm 24.11 source, read_config.c and the plugins):
* defaults: JobRequeue=1, HealthCheckNodeState=ANY, ReturnToService=0, PrologEpilogTimeout
  unset = wait for ever; PrologTimeout/EpilogTimeout (25.05+) override PrologEpilogTimeout;
* job_submit.lua and cli_filter.lua are read from slurm.conf's directory; without the file,
  slurmctld (JobSubmitPlugins=lua) and sbatch/salloc/srun (CliFilterPlugins=lua) stop at start;
* SchedulerParameters' options are looked up case-insensitively; max_switch_wait defaults to 300 s;
* each Prolog=/Epilog= line is one glob (prep_script_slurmd.c): a pattern that matches no file
  fails the job's prolog, and a comma is part of the pattern, not a separator; HealthCheckProgram
  is one program, run by its path as written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpuwarden.slurmconf.keys import Version
from gpuwarden.slurmconf.read import Setting, SlurmConf

FEATURES = {"health": "health gating", "ckpt": "checkpointing", "placement": "placement",
            "lemon": "lemon draining"}
OK, MISSING, CONFLICT, UNREAD = "ok", "missing", "conflict", "unread"
# The sh wrappers' limit for the prolog and epilog (prolog/gpuwarden-hook.sh GW_HOOK_LIMIT) and
# the margin the admin guide keeps below Slurm's timeout ("The time limits nest").
HOOK_LIMIT_S = 270
HOOK_MARGIN_S = 30
HOOK_TIMEOUT_S = HOOK_LIMIT_S + HOOK_MARGIN_S
OWN_TIMEOUTS: Version = (25, 5)  # PrologTimeout and EpilogTimeout
SWITCH_WAIT_S = 3600
SLURM_SWITCH_WAIT_S = 300
# Where the admin guide installs the hooks; the check accepts any directory (the file name
# says which hook it is).
# Where a site finds gpuwarden's plugins/ (Lua filters) to copy beside slurm.conf.
FROM = "`gpuwarden install-files PREFIX` puts them in PREFIX/plugins"
HOOKS = {"Prolog": "/opt/gpuwarden/prolog/gpuwarden-prolog",
         "Epilog": "/opt/gpuwarden/epilog/gpuwarden-epilog",
         "HealthCheckProgram": "/opt/gpuwarden/prolog/gpuwarden-healthcheck"}


@dataclass(frozen=True)
class Site:
    """What the check sees besides slurm.conf: the files in its directory (name -> their text;
    a name there but not readable as a file is in ``unusable`` instead, with why), the longest
    [placement] wait_s of a "preferred" partition, how to expand a glob
    (Prolog=/etc/slurm/prolog.d/*), the Slurm release at hand (None: unknown) and whether the
    gpuwarden config describes the cluster ([cluster] set in the file)."""

    beside: Mapping[str, str] = field(default_factory=dict)
    # name -> why it cannot be used; Beside.denied: only we may not read it (not Slurm, root).
    unusable: Mapping[str, Beside] = field(default_factory=dict)
    placement_wait_s: int = 0
    # The prolog's and epilog's limit: GPUWARDEN_HOOK_LIMIT_S in the hooks' defaults file,
    # when this host has one the hooks would read ("" = the wrappers' own limit).
    hook_limit_s: int = HOOK_LIMIT_S
    hook_limit_from: str = ""
    expand: Callable[[str], list[str]] = lambda pattern: []
    slurm_version: Version | None = None
    cluster_set: bool = False


@dataclass(frozen=True)
class Beside:
    """A file beside slurm.conf that is there (a name, a link) but that could not be read."""

    why: str
    denied: bool = False  # permission: Slurm (root) may well read it


@dataclass(frozen=True)
class Verdict:
    severity: str
    found: str
    fix: str = ""  # the exact line to add or change, or what to do before it
    # A list key lacks this need's item: the fix ends with the one merged line for the key.
    item: bool = False


Judge = Callable[["Need", SlurmConf, Site], "Verdict | None"]


@dataclass(frozen=True)
class Need:
    key: str
    features: tuple[str, ...]
    value: str  # what the merged block sets (for a list key: this need's item of the list)
    why: str
    judge: Judge
    listed: bool = False  # ``value`` is one item of a comma-separated list
    block: bool = True  # part of the merged block (False: a note there, for some sites only)


def items(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def option_name(item: str) -> str:
    """A SchedulerParameters option's name (max_switch_wait=3600 -> max_switch_wait), or a
    plugin's (job_submit/lua -> lua)."""
    return item.split("=", 1)[0].rsplit("/", 1)[-1].lower()


def merged(key: str, current: str, wanted: list[str]) -> str:
    """``key=`` the current list with the wanted items added (an option given with another
    value is replaced): the exact line to write."""
    out = items(current)
    for want in wanted:
        names = [option_name(i) for i in out]
        if option_name(want) in names:
            out[names.index(option_name(want))] = want
        else:
            out.append(want)
    return f"{key}={','.join(out)}"


def _where(conf: SlurmConf, key: str) -> str:
    s = conf.last(key)
    return f"{s.key}={s.value} ({s.where})" if s else ""


def _int(value: str) -> int | None:
    return int(value) if value.strip().isdigit() else None


# ---- judges -----------------------------------------------------------------------------------
def hook(need: Need, conf: SlurmConf, site: Site) -> Verdict:
    name = os.path.basename(need.value)
    found = conf.all(need.key)
    if not found:
        return Verdict(MISSING, f"{need.key} not set: {need.why}", f"add: {need.key}={need.value}")
    globbed = need.key.lower() in ("prolog", "epilog")
    listed = [s for s in found if "," in s.value]
    if listed:
        return _comma(need, listed[0], globbed)
    for s in found:
        # A glob (Prolog=/etc/slurm/prolog.d/*) is expanded on this host; HealthCheckProgram
        # is run by its path as written.
        names = site.expand(s.value) if globbed and any(c in s.value for c in "*?[") \
            else [s.value]
        if any(os.path.basename(p) == name for p in names):
            return Verdict(OK, f"{s.key}={s.value} ({s.where})")
    shown = ", ".join(f"{s.value} ({s.where})" for s in found)
    if globbed:
        return Verdict(MISSING, f"{need.key}={shown} does not run gpuwarden's {name} (Slurm "
                       "24.05+ runs every Prolog=/Epilog= line; older Slurm only the last)",
                       f"add: {need.key}={need.value}")
    return Verdict(CONFLICT, f"{need.key}={shown}: Slurm runs one health check program, and "
                   f"it is not gpuwarden's {name}",
                   f"set: {need.key}={need.value}, or have yours run it too")


def _comma(need: Need, s: Setting, globbed: bool) -> Verdict:
    """A hook line naming several paths with commas: Slurm takes the whole value as one path
    (Prolog/Epilog: one glob), which names no file."""
    paths = items(s.value)
    found = f"{s.key}={s.value} ({s.where})"
    if globbed:
        return Verdict(CONFLICT, f"{found}: Slurm reads this as ONE path (a glob), not a list; it "
                       f"matches no file, so every job's {need.key.lower()} fails and the node "
                       "drains", "one line per path: " + " and ".join(
                           f"{need.key}={p}" for p in dict.fromkeys([*paths, need.value])))
    return Verdict(CONFLICT, f"{found}: Slurm runs ONE program, by this whole value as its path, "
                   "which is no file: no health check runs", f"set: {need.key}={need.value} "
                   f"(and have it run yours), or {need.key}=<yours> that runs {need.value}")


def positive(need: Need, conf: SlurmConf, _site: Site) -> Verdict:
    s = conf.last(need.key)
    n = _int(s.value) if s else 0
    if n:
        return Verdict(OK, _where(conf, need.key))
    what = f"{_where(conf, need.key)}" if s else f"{need.key} not set"
    return Verdict(MISSING, f"{what}: {need.why}", f"set: {need.key}={need.value}")


def node_state(need: Need, conf: SlurmConf, _site: Site) -> Verdict:
    s = conf.last(need.key)
    if s is None:
        return Verdict(OK, f"{need.key} not set (Slurm's default: ANY)")
    if "any" in (option_name(i) for i in items(s.value)):
        return Verdict(OK, _where(conf, need.key))
    return Verdict(CONFLICT, f"{_where(conf, need.key)}: {need.why}",
                   f"set: {need.key}={need.value}")


def keys_for(key: str, version: Version | None) -> tuple[str, ...]:
    """The keys a release writes ``key`` as: from 25.05 the hook timeout is two keys
    (PrologEpilogTimeout is still read there, but deprecated); an unknown release gets the one
    key every supported release reads."""
    if key == "PrologEpilogTimeout" and version is not None and version >= OWN_TIMEOUTS:
        return ("PrologTimeout", "EpilogTimeout")
    return (key,)


def timeouts(need: Need, conf: SlurmConf, site: Site) -> Verdict:
    floor = site.hook_limit_s + HOOK_MARGIN_S
    limit = f"{site.hook_limit_s} s" + (f", {site.hook_limit_from}" if site.hook_limit_from else "")
    both = conf.last("PrologEpilogTimeout")
    short: list[str] = []
    seen: list[str] = []
    # Before 25.05 these two are unknown keys (reported as such) and override nothing.
    own_too = site.slurm_version is None or site.slurm_version >= OWN_TIMEOUTS
    for own in ("PrologTimeout", "EpilogTimeout"):
        s = (conf.last(own) if own_too else None) or both
        if s is None:
            continue
        seen.append(f"{s.key}={s.value} ({s.where})")
        n = _int(s.value)
        if n is None or n < floor:
            short.append(s.key)
    if not seen:
        return Verdict(OK, f"{need.key} not set: Slurm waits for the prolog and epilog for "
                       f"ever; gpuwarden's hooks end themselves within {limit}")
    if not short:
        return Verdict(OK, ", ".join(dict.fromkeys(seen)))
    fixes = " and ".join(f"{k}={max(floor, int(need.value))}" for k in dict.fromkeys(short))
    return Verdict(CONFLICT, f"{', '.join(dict.fromkeys(seen))}: below {floor} s, the hooks' "
                   f"own limit ({limit}) + {HOOK_MARGIN_S} s: slurmd drains a node whose prolog "
                   "it has to kill (\"Prolog error\")",
                   f"set: {fixes} (or GPUWARDEN_HOOK_LIMIT_S in the hooks' defaults file "
                   f"{HOOK_MARGIN_S} s below yours)")


def listed(need: Need, conf: SlurmConf, _site: Site) -> Verdict:
    s = conf.last(need.key)
    have = {option_name(i): i for i in items(s.value)} if s else {}
    if option_name(need.value) in have:
        return Verdict(OK, _where(conf, need.key))
    what = f"{need.value} not in {_where(conf, need.key)}" if s else f"{need.key} not set"
    return Verdict(MISSING, f"{what}: {need.why}", item=True)


# PrologFlags that turn on Alloc too (read_config.c, prolog_str2flags).
_ALLOC = ("alloc", "contain", "runinjob", "x11", "forcerequeueonfail")


def prolog_flags(need: Need, conf: SlurmConf, _site: Site) -> Verdict:
    """Alloc: every node's prolog runs when the job is allocated (without it, a node's prolog
    runs only when a step first starts there, so the batch script runs on the first node
    before the others are gated). DeferBatch: slurmctld sends the batch script only once every
    node's prolog passed; it acts only while slurmctld holds the job for its prologs, which
    NoHold turns off (node_scheduler.c, agent.c)."""
    s = conf.last(need.key)
    have = [option_name(i) for i in items(s.value)] if s else []
    if option_name(need.value) == "deferbatch" and "nohold" in have:
        keep = [i for i in items(s.value if s else "") if option_name(i) != "nohold"]
        fix = merged(need.key, ",".join(keep), ["Alloc", "DeferBatch"] if not
                     set(have) & set(_ALLOC) else ["DeferBatch"])
        return Verdict(CONFLICT, f"{_where(conf, need.key)}: NoHold lets the batch script start "
                       "before every node's prolog has passed (DeferBatch does nothing with it)",
                       f"set: {fix}")
    accepted = _ALLOC if option_name(need.value) == "alloc" else (option_name(need.value),)
    if set(have) & set(accepted):
        return Verdict(OK, _where(conf, need.key))
    what = f"{need.value} not in {_where(conf, need.key)}" if s else f"{need.key} not set"
    return Verdict(MISSING, f"{what}: {need.why}", item=True)


def switch_wait(need: Need, conf: SlurmConf, site: Site) -> Verdict | None:
    topo = conf.last("TopologyPlugin")
    if topo and topo.value.lower() == "topology/block":
        return None  # --switches is topology/tree's; block placement goes by --segment
    s = conf.last(need.key)
    opts = {option_name(i): i for i in items(s.value)} if s else {}
    if "max_switch_wait" not in opts:
        return Verdict(MISSING, f"max_switch_wait not in {_where(conf, need.key) or need.key}: "
                       f"{need.why}", item=True)
    n = _int(opts["max_switch_wait"].split("=", 1)[-1])
    if n is None or n < site.placement_wait_s:
        return Verdict(CONFLICT, f"{opts['max_switch_wait']} ({s.where if s else ''}) is below "
                       f"[placement] wait_s={site.placement_wait_s}: Slurm cuts those waits "
                       "short", item=True)
    return Verdict(OK, f"{opts['max_switch_wait']} ({s.where if s else ''})")


def _one_of(need: Need, conf: SlurmConf, accepted: tuple[str, ...]) -> Verdict:
    s = conf.last(need.key)
    if s is not None and s.value.lower() in accepted:
        return Verdict(OK, _where(conf, need.key))
    what = _where(conf, need.key) if s else f"{need.key} not set"
    return Verdict(MISSING if s is None else CONFLICT, f"{what}: {need.why}",
                   f"set: {need.key}={need.value}")


def one_of(*accepted: str) -> Judge:
    return lambda need, conf, _site: _one_of(need, conf, accepted)


def requeue(need: Need, conf: SlurmConf, _site: Site) -> Verdict:
    s = conf.last(need.key)
    if s is None:
        return Verdict(OK, f"{need.key} not set (Slurm's default: 1)")
    if (_int(s.value) or 0) >= 1:
        return Verdict(OK, _where(conf, need.key))
    return Verdict(CONFLICT, f"{_where(conf, need.key)}: {need.why}",
                   f"set: {need.key}={need.value}")


def topology(need: Need, conf: SlurmConf, site: Site) -> Verdict:
    v = _one_of(need, conf, ("topology/tree", "topology/block"))
    names = ("topology.conf", "topology.yaml")
    # Only Slurm's reading matters here: a file we may not read is there all the same.
    there = {*site.beside, *(n for n, b in site.unusable.items() if b.denied)}
    if v.severity != OK or "topology.conf" in there:
        return v
    where = f"{conf.directory}/topology.conf"
    if "topology.yaml" in there:
        # Slurm 25.05+ may read its switches from topology.yaml; gpuwarden's daemon and
        # cli_filter.lua read topology.conf only, and without it pack nothing.
        return Verdict(MISSING, f"{v.found} and {conf.directory}/topology.yaml, but no "
                       "topology.conf: gpuwarden's placement (its daemon and cli_filter.lua) "
                       "reads the switches from topology.conf only, and without it sets no "
                       "switch count", f"write {where} describing the same switches as "
                       "topology.yaml (man topology.conf; Slurm keeps reading topology.yaml)")
    broken = "; ".join(f"{conf.directory}/{n}: {site.unusable[n].why}"
                       for n in names if n in site.unusable)
    # Rendered from a [cluster] the site never set, it would describe gpuwarden's example
    # nodes, and Slurm only warns about unknown nodes: placement without real switches.
    fix = f"write it: gpuwarden slurm-conf --part topology.conf > {where}" if site.cluster_set \
        else (f"describe your switches in {where} (man topology.conf); `gpuwarden slurm-conf "
              "--part topology.conf` writes one only once [cluster] in the gpuwarden config "
              "describes your nodes")
    return Verdict(MISSING, f"{v.found}, but {broken or 'no topology.conf beside slurm.conf'}: "
                   "Slurm knows no switches to pack jobs into", fix)


def lua_plugin(script: str, stops: str) -> Judge:
    """JobSubmitPlugins / CliFilterPlugins: lua listed, and its script beside slurm.conf (the
    order matters: the script first, or ``stops``)."""
    def judge(need: Need, conf: SlurmConf, site: Site) -> Verdict | None:
        if need.key == "CliFilterPlugins":
            topo = conf.last("TopologyPlugin")
            if not (topo and topo.value.lower() == "topology/block"):
                return None  # only topology/block needs the client-side --segment
        path = f"{conf.directory}/{script}"
        v = listed(need, conf, site)
        bad = site.unusable.get(script)
        if v.severity != OK:
            first = "" if script in site.beside else \
                f"first copy {script} from gpuwarden's plugins/ ({FROM}) to {path}, then "
            return Verdict(v.severity, v.found, first, item=True)
        if bad is not None and bad.denied:
            return Verdict(UNREAD, f"{v.found}; {path}: {bad.why}: whether it is gpuwarden's "
                           "or loads it is unknown")
        if script not in site.beside:
            what = f"{path}: {bad.why}" if bad else f"{path} is absent"
            return Verdict(CONFLICT, f"{v.found} but {what}: {stops}",
                           f"copy {script} from gpuwarden's plugins/ ({FROM}) to {path} "
                           "before (re)starting")
        if "gpuwarden" not in site.beside[script]:
            return Verdict(MISSING, f"{v.found}; {path} is not gpuwarden's and does not load it",
                           f"call gpuwarden's {script} from it (docs/placement.md, Setup)")
        return v
    return judge


def _switch_wait_value(site: Site) -> str:
    return f"max_switch_wait={max(SWITCH_WAIT_S, site.placement_wait_s)}"


NEEDS: tuple[Need, ...] = (
    Need("GresTypes", ("health", "placement"), "gpu",
         "GPUs are GRES: jobs ask for them and the prolog checks the job's own GPUs", listed,
         listed=True),
    Need("Prolog", ("health", "ckpt"), HOOKS["Prolog"],
         "the prolog gates every job on the node's health and stages checkpoints into "
         "requeued jobs", hook),
    Need("Epilog", ("health",), HOOKS["Epilog"],
         "the epilog checks a node deeper after a failed job", hook),
    Need("HealthCheckProgram", ("health",), HOOKS["HealthCheckProgram"],
         "the periodic check drains failing nodes and resumes repaired ones", hook),
    Need("HealthCheckInterval", ("health",), "300",
         "how often slurmd runs the health check (unset or 0: never)", positive),
    Need("HealthCheckNodeState", ("health",), "ANY",
         "run the health check on nodes in every state: on busy ones (a new fault drains "
         "them) and on drained ones (a repaired node is resumed)", node_state),
    Need("PrologEpilogTimeout", ("health", "ckpt"), str(HOOK_TIMEOUT_S),
         f"at least the hooks' own limit ({HOOK_LIMIT_S} s) + {HOOK_MARGIN_S} s: slurmd drains "
         f"a node whose prolog it has to kill (\"Prolog error\")", timeouts),
    Need("PrologFlags", ("health", "ckpt"), "Alloc",
         "every node's prolog runs when the job is allocated (by default a node's prolog runs "
         "only when a step first starts there: the batch script runs on the first node before "
         "the others' prologs have gated them)", prolog_flags, listed=True),
    Need("PrologFlags", ("health", "ckpt"), "DeferBatch",
         "the batch script starts only once every node's prolog has passed (with Alloc alone "
         "it starts when the first node's has)", prolog_flags, listed=True),
    Need("SchedulerParameters", ("health",), "nohold_on_prolog_fail",
         "a job whose prolog fails on a bad node is requeued elsewhere instead of held",
         listed, listed=True),
    Need("SchedulerParameters", ("placement",), f"max_switch_wait={SWITCH_WAIT_S}",
         f"the longest a gang job waits for its switches (Slurm's default: "
         f"{SLURM_SWITCH_WAIT_S} s)", switch_wait, listed=True),
    Need("ReturnToService", ("health",), "2",
         "a node that went DOWN (not responding, rebooted after a GPU reset) comes back when "
         "its slurmd registers (0, the default: only when someone resumes it)",
         one_of("1", "2")),
    Need("JobRequeue", ("ckpt",), "1",
         "requeue jobs after a node failure (0: only jobs submitted with --requeue, as "
         "ckpt/train.sbatch is)", requeue),
    Need("AccountingStorageType", ("lemon",), "accounting_storage/slurmdbd",
         "the lemon scan reads job and node history from slurmdbd (sacct, sacctmgr)",
         one_of("accounting_storage/slurmdbd")),
    Need("TopologyPlugin", ("placement",), "topology/tree",
         "gang jobs are packed by leaf switch (topology/block works too)", topology),
    Need("JobSubmitPlugins", ("placement",), "lua",
         "the submit filter sets each gang job's switches and excluded nodes",
         lua_plugin("job_submit.lua", "slurmctld does not start (fatal: failed to initialize "
                    "job_submit plugin)"), listed=True),
    Need("CliFilterPlugins", ("placement",), "lua",
         "topology/block only: cli_filter.lua sets --segment for gang jobs",
         lua_plugin("cli_filter.lua", "sbatch, salloc and srun stop (fatal: failed to "
                    "initialize cli_filter plugin)"), listed=True, block=False),
)


def wanted(need: Need, site: Site) -> str:
    """The value or list item to write for ``need`` at this site."""
    if need.judge is switch_wait:
        return _switch_wait_value(site)
    return need.value
