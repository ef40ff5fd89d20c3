"""The keys slurm.conf may hold, release by release, for `gpuwarden slurm-conf --check`. Pure.

slurmctld, slurmd and every client stop at a key their release does not know ("Parsing error at
unrecognized key", then fatal: "Unable to process configuration file"), so a typo or a key of a
newer release is as bad as a missing file. The names are those of ``slurm_conf_options[]`` in
src/common/read_config.c of each release (24.05.8, 24.11.7, 25.05.8, 25.11.7, 26.05.3: no key changed
within a release series); Slurm looks them up case-insensitively.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

Version = tuple[int, int]

OLDEST: Version = (24, 5)  # the oldest release gpuwarden supports, and the list's base

_BASE = """
AccountingStorageBackupHost AccountingStorageEnforce AccountingStorageExternalHost
AccountingStorageHost AccountingStorageLoc AccountingStorageParameters AccountingStoragePass
AccountingStoragePort AccountingStorageTRES AccountingStorageType AccountingStorageUser
AccountingStoreFlags AccountingStoreJobComment AcctGatherEnergyType AcctGatherFilesystemType
AcctGatherInfinibandType AcctGatherInterconnectType AcctGatherNodeFreq AcctGatherProfileType
AllowSpecResourcesUsage AuthAltParameters AuthAltTypes AuthInfo AuthType BackupAddr
BackupController BatchStartTimeout BcastExclude BcastParameters BurstBufferParameters
BurstBufferType CliFilterPlugins ClusterName
CommunicationParameters CompleteWait ControlAddr ControlMachine CoreSpecPlugin CpuFreqDef
CpuFreqGovernors CredType CryptoType DebugFlags DefCPUPerGPU DefMemPerCPU
DefMemPerGPU DefMemPerNode DependencyParameters DisableRootJobs DownNodes EioTimeout
EnforcePartLimits Epilog EpilogMsgTime EpilogSlurmctld ExtSensorsFreq ExtSensorsType
FairShareDampeningFactor FastSchedule FederationParameters FirstJobId FrontendName GetEnvTimeout
GpuFreqDef GresTypes GroupUpdateForce GroupUpdateTime HashPlugin HealthCheckInterval
HealthCheckNodeState HealthCheckProgram InactiveLimit InteractiveStepOptions
JobAcctGatherFrequency JobAcctGatherParams JobAcctGatherType JobCompHost JobCompLoc
JobCompParams JobCompPass JobCompPort JobCompType JobCompUser JobContainerType
JobCredentialPrivateKey JobCredentialPublicCertificate JobFileAppend JobRequeue JobSubmitPlugins
KeepAliveTime KillOnBadExit KillWait LaunchParameters LaunchType Licenses LogTimeFormat
MailDomain MailProg MaxArraySize MaxBatchRequeue MaxDBDMsgs MaxJobCount MaxJobId MaxMemPerCPU
MaxMemPerNode MaxNodeCount MaxStepCount MaxTasksPerNode MCSParameters MCSPlugin MessageTimeout
MinJobAge MpiDefault MpiParams NodeFeaturesPlugins NodeName NodeSet OverTimeLimit PartitionName
PluginDir PlugStackConfig PowerParameters PowerPlugin PreemptExemptTime PreemptMode
PreemptParameters PreemptType PrEpParameters PrEpPlugins PriorityCalcPeriod
PriorityDecayHalfLife PriorityFavorSmall PriorityFlags PriorityMaxAge PriorityParameters
PrioritySiteFactorParameters PrioritySiteFactorPlugin PriorityType PriorityUsageResetPeriod
PriorityWeightAge PriorityWeightAssoc PriorityWeightFairshare PriorityWeightJobSize
PriorityWeightPartition PriorityWeightQOS PriorityWeightTRES PrivateData ProctrackType Prolog
PrologEpilogTimeout PrologFlags PrologSlurmctld PropagatePrioProcess PropagateResourceLimits
PropagateResourceLimitsExcept RebootProgram ReconfigFlags RequeueExit RequeueExitHold
ResumeFailProgram ResumeProgram ResumeRate ResumeTimeout ResvEpilog ResvOverRun ResvProlog
ReturnToService RoutePlugin SallocDefaultCommand SbcastParameters SchedulerParameters
SchedulerTimeSlice SchedulerType ScronParameters SelectType SelectTypeParameters SlurmctldAddr
SlurmctldDebug SlurmctldHost SlurmctldLogFile SlurmctldParameters SlurmctldPidFile SlurmctldPort
SlurmctldPrimaryOffProg SlurmctldPrimaryOnProg SlurmctldSyslogDebug SlurmctldTimeout SlurmdDebug
SlurmdLogFile SlurmdParameters SlurmdPidFile SlurmdPort SlurmdSpoolDir SlurmdSyslogDebug
SlurmdTimeout SlurmdUser SlurmSchedLogFile SlurmSchedLogLevel SlurmUser SrunEpilog SrunPortRange
SrunProlog StateSaveLocation SuspendExcNodes SuspendExcParts SuspendExcStates SuspendProgram
SuspendRate SuspendTime SuspendTimeout SwitchParameters SwitchType TaskEpilog TaskPlugin
TaskPluginParam TaskProlog TCPTimeout TLSParameters TLSType TmpFS TopologyParam TopologyPlugin
TrackWCKey TreeWidth UnkillableStepProgram UnkillableStepTimeout UsePAM VSizeFactor WaitTime
X11Parameters
"""
# What each later release added to, and removed from, the one before it.
_CHANGES: dict[Version, tuple[str, str]] = {
    (24, 11): ("CertmgrParameters CertmgrType DataParserParameters", ""),
    (25, 5): ("CertgenParameters CertgenType EpilogTimeout PrologTimeout", "FrontendName"),
    (25, 11): ("CliFilterParameters HttpParserType JobCompPassScript MetricsType NamespaceType "
               "UrlParserType", "AccountingStorageLoc"),
    (26, 5): ("HealthCheckTimeout LicenseParameters MetricsAuthUsers MetricsParameters "
              "PowerAction SlurmctldHttpAuthParameters SlurmdHttpAuthParameters", ""),
}
RELEASES: tuple[Version, ...] = (OLDEST, *_CHANGES)
NEWEST: Version = RELEASES[-1]


@dataclass(frozen=True)
class Span:
    """The releases that know a key: from ``since`` up to, not including, ``until``."""

    name: str
    since: Version
    until: Version | None = None

    def known_in(self, version: Version) -> bool:
        return self.since <= version and (self.until is None or version < self.until)


def _spans() -> dict[str, Span]:
    spans = {k.lower(): Span(k, OLDEST) for k in _BASE.split()}
    for release, (added, removed) in _CHANGES.items():
        for k in added.split():
            spans[k.lower()] = Span(k, release)
        for k in removed.split():
            spans[k.lower()] = Span(spans[k.lower()].name, spans[k.lower()].since, release)
    return spans


SPANS = _spans()


def show(version: Version) -> str:
    return f"{version[0]}.{version[1]:02d}"


def parse_version(text: str) -> Version | None:
    """The release (major, minor) in ``scontrol --version``'s "slurm 24.11.7" or a user's
    "24.11" / "25.05.2"; None when there is none."""
    m = re.search(r"(?<![\w.])(\d{2})\.(\d{1,2})(?:\.\d+)?(?![\w.])", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_release(text: str) -> Version | None:
    """A release as a user names it: "24.11" or "25.05.2"; None for anything else."""
    m = re.fullmatch(r"\s*(\d{2})\.(\d{1,2})(?:\.\d+)?\s*", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def release_for(version: Version) -> Version:
    """The listed release whose keys ``version`` has: the newest one not after it (an older
    Slurm is judged by 24.05's list, a newer one by the newest list gpuwarden knows)."""
    return max((r for r in RELEASES if r <= version), default=OLDEST)


def judge_key(key: str, version: Version | None) -> tuple[str, str] | None:
    """(why Slurm stops at ``key``, what to do), or None when the Slurm at hand knows it.
    ``version`` None: unknown, so a key not known to every listed release is reported."""
    span = SPANS.get(key.lower())
    if span is None:
        return _unknown(key, version)
    if version is None:
        return _unsure(key, span)
    release = release_for(version)
    if span.known_in(release):
        return None
    if release < span.since:
        return (f"{key} needs Slurm >= {show(span.since)}, this is {show(version)}: slurmctld "
                "and slurmd stop at it (unrecognized key)", "remove it (or upgrade Slurm first)")
    return (f"{key} was removed in Slurm {show(span.until or NEWEST)}, this is {show(version)}: "
            "slurmctld and slurmd stop at it (unrecognized key)", "remove it")


def _unknown(key: str, version: Version | None) -> tuple[str, str]:
    close = difflib.get_close_matches(key.lower(), list(SPANS), n=1, cutoff=0.8)
    hint = f"did you mean {SPANS[close[0]].name}? " if close else ""
    known = f"{key} is not a slurm.conf key in Slurm {show(OLDEST)} to {show(NEWEST)}"
    if version is not None and version > NEWEST:
        return (f"{known}, the releases gpuwarden knows (yours is {show(version)}): unless "
                "your release added it, slurmctld and slurmd stop at it (unrecognized key)",
                f"{hint}look it up in your release's man slurm.conf")
    return (f"{known}: slurmctld and slurmd stop at it (unrecognized key)",
            f"{hint}correct or remove it")


def _unsure(key: str, span: Span) -> tuple[str, str] | None:
    """The release is unknown: a key that only some listed releases know."""
    ask = "pass --slurm-version (or run this where scontrol is) to check it against yours"
    if span.since > OLDEST:
        return (f"{key} needs Slurm >= {show(span.since)}: an older slurmctld stops at it "
                "(unrecognized key)", ask)
    if span.until is not None:
        return (f"{key} was removed in Slurm {show(span.until)}: a newer slurmctld stops at it "
                "(unrecognized key)", ask)
    return None
