# gpuwarden's Slurm hooks, in POSIX sh: sourced by gpuwarden-prolog, gpuwarden-epilog and
# gpuwarden-healthcheck (see docs/admin-guide.md).
#
# Shell, not Python, so that it runs where Python or gpuwarden cannot: a missing interpreter,
# a venv the hook does not know, a broken install. Those fail OPEN (exit 0, so Slurm drains no
# node for "Prolog error") and LOUDLY (syslog daemon.err, tag gpuwarden, and stderr). Only the
# prolog's deliberate failure (it drained the node itself: gpuwarden.hooks.run.EXIT_FAIL_JOB)
# reaches Slurm as a non-zero status.
#
# The interpreter comes from GPUWARDEN_PYTHON= in the defaults file the wrapper names (e.g.
# /etc/default/gpuwarden), read only when it is ours and nobody else can write it; otherwise
# /usr/bin/python3. Never from the job's or slurmd's environment.

GW_FAIL_JOB=86
GW_CANNOT_IMPORT=87
# Wall-clock limits (s): the health check ends before Slurm's 60 s kill; the prolog and epilog
# 30 s before PrologEpilogTimeout=300 (docs/admin-guide.md). gpuwarden.hooks.cli keeps its
# own run limits below these (a unit test holds them together).
GW_HEALTHCHECK_LIMIT=55
GW_HOOK_LIMIT=270
GW_UNTRUSTED=88
# The interpreter starts as `PYTHON -I -S gpuwarden_pystart.py HOOK STDLIB` (the file beside
# this one): -I ignores PYTHON* variables, the user site and the working directory; -S reads no
# site directory (no .pth file, no sitecustomize) until gpuwarden_pystart.py has checked them.
GW_NL='
'

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
                    # 0 would be no limit at all in timeout(1): never allowed.
                    '' | *[!0-9]* | 0* | ??????*) gw_say "$2" "ignoring" \
                        "GPUWARDEN_HOOK_LIMIT_S=$_gw_lim in $1: not a whole number of seconds" \
                        "from 1 to 99999" ;;
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

gw_tool() { # NAME: sets _gw_tool to /usr/bin/NAME or /bin/NAME (never PATH), or empty
    _gw_tool=
    for _gw_t in "/usr/bin/$1" "/bin/$1"; do
        if [ -x "$_gw_t" ]; then _gw_tool=$_gw_t; return 0; fi
    done
    return 1
}

gw_trim() { # TEXT: sets _gw_trimmed to TEXT without the blanks (space, tab, CR...) at its ends
    _gw_trimmed=${1#"${1%%[![:space:]]*}"}
    _gw_trimmed=${_gw_trimmed%"${_gw_trimmed##*[![:space:]]}"}
}

gw_walk() { # PATH [MISSING_OK]: adds to _gw_seen each directory a lookup of PATH passes through
    # and what it names, links followed hop by hop as exec and import follow them; sets
    # _gw_real to the path reached. False when something on the way is missing (with
    # MISSING_OK: true, the directory it is missing from being the last seen) or loops.
    _gw_cur=
    _gw_todo=$1
    _gw_links=0
    while :; do
        _gw_todo=${_gw_todo#"${_gw_todo%%[!/]*}"}
        [ -n "$_gw_todo" ] || break
        _gw_name=${_gw_todo%%/*}
        _gw_todo=${_gw_todo#"$_gw_name"}
        _gw_seen=$_gw_seen${_gw_cur:-/}$GW_NL
        case $_gw_name in
            .) continue ;;
            ..) _gw_cur=${_gw_cur%/*}; continue ;;
        esac
        if [ -L "$_gw_cur/$_gw_name" ]; then
            _gw_links=$((_gw_links + 1))
            [ "$_gw_links" -le 40 ] || return 1
            _gw_to=$("$_gw_readlink" -- "$_gw_cur/$_gw_name") && [ -n "$_gw_to" ] || return 1
            case $_gw_to in /*) _gw_cur= ;; esac
            _gw_todo=$_gw_to/$_gw_todo
            continue
        fi
        if [ ! -e "$_gw_cur/$_gw_name" ]; then
            [ -n "$2" ] || return 1
            _gw_real=
            return 0
        fi
        _gw_cur=$_gw_cur/$_gw_name
    done
    _gw_real=${_gw_cur:-/}
    _gw_seen=$_gw_seen$_gw_real$GW_NL
}

gw_others_can_change() { # DEPTH PATH...: prints the first path (or, at DEPTH 1, entry directly
    # in it) that is not root's or that group or others can write; true when there is one, or
    # when find cannot tell.
    # The standard library's own site-packages is checked by gpuwarden_pystart.py, and only
    # when the hooks' Python reads it (a venv made with --system-site-packages).
    _gw_depth=$1
    shift
    _gw_bad=$("$_gw_find" "$@" -maxdepth "$_gw_depth" ! -type l \( ! -user 0 -o -perm -020 \
        -o -perm -002 \) ! -name site-packages ! -name dist-packages -print 2>&1) ||
        { printf '%s' "cannot check: ${_gw_bad:-find failed}"; return 0; }
    [ -n "$_gw_bad" ] || return 1
    printf '%s' "${_gw_bad%%"$GW_NL"*}"
}

gw_check_python() { # PYTHON: sets _gw_why (empty when root alone can change what PYTHON runs
    # before gpuwarden_pystart.py checks the rest) and _gw_stdlib (the standard library found)
    _gw_why=
    _gw_stdlib=
    _gw_seen=
    if ! gw_tool find; then _gw_why="no find(1) in /usr/bin or /bin to check it"; return; fi
    _gw_find=$_gw_tool
    if ! gw_tool readlink; then _gw_why="no readlink(1) in /usr/bin or /bin"; return; fi
    _gw_readlink=$_gw_tool
    if ! gw_walk "$1"; then _gw_why="cannot follow $1 to a file"; return; fi
    # A script (#!) runs another interpreter, one this never checked (#!/usr/bin/env python3:
    # whichever PATH finds). Its first line: up to the first newline byte (an ELF header has
    # one within a few hundred bytes).
    _gw_l=
    IFS= read -r _gw_l <"$_gw_real" || :
    case $_gw_l in
        '#!'*) _gw_why="$1 is a script (${_gw_l%%"$GW_NL"*}): name the interpreter itself in"
            _gw_why="$_gw_why GPUWARDEN_PYTHON"
            return ;;
    esac
    # A ._pth file beside the interpreter (as named or its real file) replaces sys.path, on
    # Linux too: Python would import from where it says before anything could check it.
    for _gw_x in "$1._pth" "$_gw_real._pth"; do
        if [ -e "$_gw_x" ] || [ -L "$_gw_x" ]; then
            _gw_why="$_gw_x: Python would import from where it says (not supported here)"
            return
        fi
    done
    # Where Python finds its standard library: <prefix>/lib/python3.N (lib64 on Fedora) beside
    # <prefix>/bin,
    # from the interpreter's real file, and in a venv from pyvenv.cfg's home (which it reads).
    _gw_bins=${_gw_real%/*}
    _gw_d=${1%/*}
    # Both pyvenv.cfg files, where both are there: Python takes home from the one a level up
    # first, site.py its other keys from the one beside the interpreter first.
    for _gw_cfg in "${_gw_d%/*}/pyvenv.cfg" "$_gw_d/pyvenv.cfg"; do
        [ -e "$_gw_cfg" ] || [ -L "$_gw_cfg" ] || continue
        if ! gw_walk "$_gw_cfg"; then _gw_why="cannot follow $_gw_cfg"; return; fi
        # Python reads `home` as key.strip().lower() == "home" and value.strip(): any case,
        # any whitespace around either. A line this cannot read as plainly is refused.
        while IFS= read -r _gw_l || [ -n "$_gw_l" ]; do
            case $_gw_l in *[Hh][Oo][Mm][Ee]*=*) ;; *) continue ;; esac
            gw_trim "${_gw_l%%=*}"
            case $_gw_trimmed in
                [Hh][Oo][Mm][Ee]) ;;
                *[Hh][Oo][Mm][Ee]*) _gw_why="cannot read the line $_gw_l in $_gw_cfg as Python does"
                    return ;;
                *) continue ;;
            esac
            gw_trim "${_gw_l#*=}"
            _gw_h=$_gw_trimmed
            case $_gw_h in
                /*) ;;
                *) _gw_why="home = $_gw_h in $_gw_cfg is not an absolute path"; return ;;
            esac
            if ! gw_walk "$_gw_h"; then _gw_why="cannot follow home = $_gw_h in $_gw_cfg"
                return; fi
            _gw_bins=$_gw_bins$GW_NL$_gw_real
        done <"$_gw_real"
    done
    _gw_top=
    _gw_enc=
    _gw_oldifs=$IFS
    IFS=$GW_NL
    for _gw_b in $_gw_bins; do
        # A build directory's markers there point Python at a source tree's Lib/ instead.
        for _gw_x in "$_gw_b/pybuilddir.txt" "$_gw_b/Modules/Setup.local"; do
            if [ -e "$_gw_x" ] || [ -L "$_gw_x" ]; then
                IFS=$_gw_oldifs
                _gw_why="$_gw_x: Python would run as from its build directory (not supported here)"
                return
            fi
        done
        for _gw_os in "${_gw_b%/*}"/lib/python3.*/os.py "${_gw_b%/*}"/lib64/python3.*/os.py; do
            [ -f "$_gw_os" ] || continue
            gw_walk "${_gw_os%/os.py}" || continue
            case $GW_NL$_gw_stdlib in *"$GW_NL$_gw_real$GW_NL"*) continue ;; esac
            _gw_stdlib=$_gw_stdlib$_gw_real$GW_NL
            _gw_top=$_gw_top$_gw_real$GW_NL
            # Imported before any check of Python's own can run (lib-dynload: the codec
            # modules of a locale such as GBK's, which encodings imports as Python starts).
            for _gw_e in "$_gw_real/__pycache__" "$_gw_real/encodings" \
                "$_gw_real/encodings/__pycache__" "$_gw_real/lib-dynload"; do
                [ -e "$_gw_e" ] && gw_walk "$_gw_e" || continue
                _gw_top=$_gw_top$_gw_real$GW_NL
                case $_gw_e in */encodings* | */lib-dynload) _gw_enc=$_gw_enc$_gw_real$GW_NL ;; esac
            done
        done
        for _gw_z in "${_gw_b%/*}"/lib/python3*.zip; do
            if [ -e "$_gw_z" ] && gw_walk "$_gw_z"; then :; fi
        done
        # A shared build's interpreter is libpython, loaded from the prefix's lib/ (its
        # RUNPATH): pyenv, conda, python.org builds.
        for _gw_z in "${_gw_b%/*}"/lib/libpython3*.so* "${_gw_b%/*}"/lib64/libpython3*.so*; do
            [ -e "$_gw_z" ] || [ -L "$_gw_z" ] || continue
            gw_walk "$_gw_z" missing-ok && continue
            IFS=$_gw_oldifs
            _gw_why="cannot follow $_gw_z"
            return
        done
    done
    if [ -z "$_gw_stdlib" ]; then
        IFS=$_gw_oldifs
        _gw_why="found no standard library (lib/python3.N/os.py) beside the bin/ of $1 (or of its venv's home)"
        return
    fi
    # Python imports encodings (and a locale's codec from lib-dynload) as it starts: a module
    # there may be a link to elsewhere, and what it names (and the way to it) counts as well.
    if [ -n "$_gw_enc" ]; then
        _gw_ln=$("$_gw_find" $_gw_enc -maxdepth 1 -type l -print 2>&1) ||
            { IFS=$_gw_oldifs; _gw_why="cannot check: ${_gw_ln:-find failed}"; return; }
        for _gw_l in $_gw_ln; do
            case $_gw_l in /*) gw_walk "$_gw_l" missing-ok && continue ;; esac
            IFS=$_gw_oldifs
            _gw_why="cannot follow $_gw_l"
            return
        done
    fi
    _gw_bad=$(gw_others_can_change 0 $_gw_seen) || _gw_bad=$(gw_others_can_change 1 $_gw_top) ||
        _gw_bad=
    IFS=$_gw_oldifs
    _gw_stdlib=${_gw_stdlib%"$GW_NL"}
    [ -z "$_gw_bad" ] || _gw_why="$_gw_bad: not root's, or group or others can write it"
}

gw_run() { # HOOK: gpuwarden's HOOK under the limit (uses _gw_timeout, _gw_limit, _gw_py,
    # _gw_start and _gw_stdlib)
    if [ -n "$_gw_timeout" ]; then
        GPUWARDEN_HOOK_LIMIT_S=$_gw_limit "$_gw_timeout" -k 3 "$_gw_limit" \
            "$_gw_py" -I -S "$_gw_start" "$1" "$_gw_stdlib" </dev/null
    else
        GPUWARDEN_HOOK_LIMIT_S=$_gw_limit "$_gw_py" -I -S "$_gw_start" "$1" "$_gw_stdlib" </dev/null
    fi
}

gw_tail() { # FILE: its last 64 KiB at most (a runaway writer cannot make this wait)
    for _gw_t in /usr/bin/tail /bin/tail; do
        if [ -x "$_gw_t" ]; then "$_gw_t" -c 65536 -- "$1" 2>/dev/null; return 0; fi
    done
    return 0
}

gw_hook() { # HOOK DEFAULTS LOGGER START: run gpuwarden's HOOK (prolog, epilog, healthcheck);
    # START is gpuwarden_pystart.py beside this file
    gw_python "$2" "$3"
    _gw_off="health gating is OFF on this node until this is fixed"
    if [ ! -f "$_gw_py" ] || [ ! -x "$_gw_py" ]; then
        gw_say "$3" "$1: cannot run gpuwarden: interpreter $_gw_py is missing or not" \
            "executable (set GPUWARDEN_PYTHON= in $2); $_gw_off"
        return 0
    fi
    _gw_start=$4
    if [ -z "$_gw_start" ] || [ ! -f "$_gw_start" ]; then
        gw_say "$3" "$1: cannot run gpuwarden: gpuwarden_pystart.py is missing beside" \
            "gpuwarden-hook.sh (${_gw_start:-not named}): rerun gpuwarden install-files; $_gw_off"
        return 0
    fi
    # Root runs what Python imports: the interpreter and everything it reads before gpuwarden's
    # own check (gpuwarden_pystart.py) must be root's alone, checked here before it starts.
    gw_check_python "$_gw_py"
    if [ -n "$_gw_why" ]; then
        gw_say "$3" "$1: refusing to run $_gw_py as root: $_gw_why; the interpreter and" \
            "every directory it imports from must be root's and writable by nobody else" \
            "(docs/admin-guide.md, step 3); $_gw_off"
        return 0
    fi
    # A hard wall-clock limit even where Python hangs before gpuwarden's own deadlines exist
    # (an import from a hung NFS mount): Slurm kills a HealthCheckProgram at 60 s, and a hung
    # prolog holds the job in CONFIGURING (or drains the node at PrologEpilogTimeout, 300 s in
    # docs/admin-guide.md: this limit stays 30 s below it). Python's own deadlines end its run
    # before this limit (it is passed on as GPUWARDEN_HOOK_LIMIT_S).
    case $1 in
        healthcheck) _gw_limit=$GW_HEALTHCHECK_LIMIT ;;
        *) _gw_limit=$GW_HOOK_LIMIT ;;
    esac
    if [ -n "$_gw_hook_limit" ]; then
        if [ "$1" = healthcheck ] && [ "$_gw_hook_limit" -gt "$GW_HEALTHCHECK_LIMIT" ]; then
            gw_say "$3" "$1: GPUWARDEN_HOOK_LIMIT_S=$_gw_hook_limit ignored: the health check" \
                "keeps ${GW_HEALTHCHECK_LIMIT} s (Slurm kills it at 60 s)"
        else
            _gw_limit=$_gw_hook_limit
        fi
    fi
    _gw_timeout=
    for _gw_t in /usr/bin/timeout /bin/timeout; do
        if [ -x "$_gw_t" ]; then _gw_timeout=$_gw_t; break; fi
    done
    # stdout and stderr go to files, never to a pipe this script (or slurmd) reads to its end:
    # a check child stuck in the kernel that still held it would keep the hook waiting past
    # every limit. Their tails are passed on afterwards; stderr's last line is quoted.
    _gw_tmp=
    for _gw_t in /usr/bin/mktemp /bin/mktemp; do
        if [ -x "$_gw_t" ]; then _gw_tmp=$("$_gw_t" -d /tmp/gpuwarden-hook.XXXXXX 2>/dev/null)
            break; fi
    done
    if [ -n "$_gw_tmp" ] && [ -d "$_gw_tmp" ]; then
        gw_run "$1" >"$_gw_tmp/out" 2>"$_gw_tmp/err"
        _gw_rc=$?
        # Usually both are empty: no tail (a process each) on every job start then.
        _gw_err=
        [ ! -s "$_gw_tmp/err" ] || _gw_err=$(gw_tail "$_gw_tmp/err")
        [ ! -s "$_gw_tmp/out" ] || gw_tail "$_gw_tmp/out"
        /bin/rm -rf -- "$_gw_tmp" 2>/dev/null || rm -rf -- "$_gw_tmp" 2>/dev/null || :
    else
        # No private temp directory (/tmp full?): pass output straight on, quote nothing.
        gw_run "$1"
        _gw_rc=$?
        _gw_err="no error output kept: /tmp unusable"
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
        "$GW_UNTRUSTED")
            gw_say "$3" "$1: refusing to run gpuwarden as root with $_gw_py ($_gw_last); the" \
                "interpreter and every directory it imports from must be root's and writable" \
                "by nobody else (docs/admin-guide.md, step 3); $_gw_off"
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
