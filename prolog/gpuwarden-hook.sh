# gpuwarden's Slurm hooks, in POSIX sh: sourced by gpuwarden-prolog, gpuwarden-epilog and
# gpuwarden-healthcheck (see docs/admin-guide.md).
#
# Shell, not Python, so that it runs where Python or gpuwarden cannot: a missing interpreter,
# a venv the hook does not know, a broken install. Those fail OPEN (exit 0, so Slurm drains no
# node for "Prolog error") and LOUDLY (syslog daemon.err, tag gpuwarden, and stderr). Only the
# prolog's deliberate failure (it drained the node itself: gpuwarden.health.hooks.EXIT_FAIL_JOB)
# reaches Slurm as a non-zero status.
#
# The interpreter comes from GPUWARDEN_PYTHON= in the defaults file the wrapper names (e.g.
# /etc/default/gpuwarden), read only when it is ours and nobody else can write it; otherwise
# /usr/bin/python3. Never from the job's or slurmd's environment.

GW_FAIL_JOB=86
GW_CANNOT_IMPORT=87
# -I: ignore PYTHON* variables, the user site and the working directory.
GW_BOOT='import sys
try:
    from gpuwarden.health.hooks import main
except Exception as exc:
    sys.stderr.write("cannot import gpuwarden.health.hooks: %r\n" % (exc,))
    sys.exit(87)
sys.exit(main(sys.argv[1:]))'

gw_say() { # LOGGER MESSAGE...: to syslog at daemon.err and to stderr
    _gw_logger=$1
    shift
    printf 'gpuwarden: %s\n' "$*" >&2
    if [ -x "$_gw_logger" ]; then
        "$_gw_logger" -p daemon.err -t gpuwarden -- "$*" 2>/dev/null || :
    fi
}

gw_writable_by_others() { # FILE: true unless find says it is neither group- nor other-writable
    for _gw_find in /usr/bin/find /bin/find; do
        if [ -x "$_gw_find" ]; then
            [ -n "$("$_gw_find" "$1" -maxdepth 0 \( -perm -020 -o -perm -002 \) -print)" ]
            return
        fi
    done
    return 0
}

gw_python() { # DEFAULTS LOGGER: sets _gw_py (and _gw_hook_limit from GPUWARDEN_HOOK_LIMIT_S)
    _gw_py=/usr/bin/python3
    _gw_hook_limit=
    [ -e "$1" ] || [ -L "$1" ] || return 0
    if [ -L "$1" ] || [ ! -f "$1" ] || [ ! -O "$1" ] || gw_writable_by_others "$1"; then
        gw_say "$2" "ignoring $1: not a regular file of ours that only we can write"
        return 0
    fi
    _gw_val=
    while IFS= read -r _gw_line || [ -n "$_gw_line" ]; do
        _gw_line=${_gw_line#export }
        case $_gw_line in
            GPUWARDEN_PYTHON=*) _gw_val=${_gw_line#GPUWARDEN_PYTHON=} ;;
            GPUWARDEN_HOOK_LIMIT_S=*)
                _gw_lim=${_gw_line#GPUWARDEN_HOOK_LIMIT_S=}
                case $_gw_lim in
                    '' | *[!0-9]*) gw_say "$2" "ignoring GPUWARDEN_HOOK_LIMIT_S=$_gw_lim in $1:" \
                        "not a whole number of seconds" ;;
                    *) _gw_hook_limit=$_gw_lim ;;
                esac
                ;;
        esac
    done <"$1"
    _gw_val=${_gw_val#[\"\']}
    _gw_val=${_gw_val%[\"\']}
    case $_gw_val in
        /*) _gw_py=$_gw_val ;;
        '') ;;
        *) gw_say "$2" "ignoring GPUWARDEN_PYTHON=$_gw_val in $1: not an absolute path" ;;
    esac
}

gw_hook() { # HOOK DEFAULTS LOGGER: run gpuwarden's HOOK (prolog, epilog, healthcheck)
    gw_python "$2" "$3"
    _gw_off="health gating is OFF on this node until this is fixed"
    if [ ! -f "$_gw_py" ] || [ ! -x "$_gw_py" ]; then
        gw_say "$3" "$1: cannot run gpuwarden: interpreter $_gw_py is missing or not" \
            "executable (set GPUWARDEN_PYTHON= in $2); $_gw_off"
        return 0
    fi
    # A hard wall-clock limit even where Python hangs before gpuwarden's own deadlines exist
    # (an import from a hung NFS mount): Slurm kills a HealthCheckProgram at 60 s, and a hung
    # prolog holds the job in CONFIGURING (or drains the node at PrologEpilogTimeout).
    case $1 in
        healthcheck) _gw_limit=55 ;;
        *) _gw_limit=300 ;;
    esac
    [ -z "$_gw_hook_limit" ] || _gw_limit=$_gw_hook_limit
    _gw_timeout=
    for _gw_t in /usr/bin/timeout /bin/timeout; do
        if [ -x "$_gw_t" ]; then _gw_timeout=$_gw_t; break; fi
    done
    # stdout goes where it went; stderr is kept to quote in the log line, then passed on.
    if [ -n "$_gw_timeout" ]; then
        { _gw_err=$("$_gw_timeout" -k 3 "$_gw_limit" "$_gw_py" -I -c "$GW_BOOT" "$1" \
            2>&1 1>&3 3>&-); _gw_rc=$?; } 3>&1
    else
        { _gw_err=$("$_gw_py" -I -c "$GW_BOOT" "$1" 2>&1 1>&3 3>&-); _gw_rc=$?; } 3>&1
    fi
    [ -z "$_gw_err" ] || printf '%s\n' "$_gw_err" >&2
    case $_gw_rc in
        0) return 0 ;;
        "$GW_FAIL_JOB") return 1 ;;
    esac
    _gw_last=$(printf '%s\n' "$_gw_err" | {
        while IFS= read -r _gw_l; do [ -z "$_gw_l" ] || _gw_keep=$_gw_l; done
        printf '%s' "${_gw_keep:-no error output}"
    })
    case $_gw_rc in
        124 | 137)
            gw_say "$3" "$1: gpuwarden did not finish within ${_gw_limit} s and was stopped" \
                "($_gw_last); the job was let through; $_gw_off"
            ;;
        "$GW_CANNOT_IMPORT")
            gw_say "$3" "$1: $_gw_py cannot import gpuwarden ($_gw_last); set" \
                "GPUWARDEN_PYTHON= in $2 to the interpreter gpuwarden is installed in; $_gw_off"
            ;;
        *)
            gw_say "$3" "$1: gpuwarden failed with exit status $_gw_rc ($_gw_last); the job" \
                "was let through; $_gw_off"
            ;;
    esac
    return 0
}
