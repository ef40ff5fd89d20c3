#!/usr/bin/env bash
# Install the host packages `make demo` and `make test` need on a fresh Debian/Ubuntu machine
# (with Docker), or fail with the exact command to run. Used by the Makefile (and so by .ci/run).
#
#   scripts/host-deps.sh [venv] [debootstrap] [lua] [chromium] [promtool]
#
# venv: python3-venv, without which Debian's and Ubuntu's python3 cannot make the .venv
#   (set PYTHON to the interpreter the Makefile uses; it must be Python >= 3.11).
# debootstrap: builds the cluster image from Debian packages (no container registry); not
#   needed while Docker is unreachable (nothing can be built) or the image is already built
#   (set PY to the venv's python to check the image's tag).
# lua: lua5.1 and lua-filesystem, which the unit tests run plugins/job_submit.lua with, as
#   slurmctld's job_submit/lua does (Lua 5.1; the filter checks its snapshot with lfs).
# chromium: the headless browser the unit tests render `gpuwarden report`'s page in.
# promtool: Prometheus's rule checker, which the unit tests check and unit-test the shipped
#   alert rules and the dashboard's queries with; Debian ships it in `prometheus`, installed
#   without its recommends (node_exporter) and with the Prometheus service it starts stopped
#   and disabled: only the tool is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=()
why=()
# Installed with --no-install-recommends, and their services stopped and disabled.
tools_only=()

image_built() {
    [ -n "${PY:-}" ] || return 1
    local tag
    tag=$("$PY" -c 'import pathlib, devcluster.image as i; print(i.image_tag(pathlib.Path(".")))' 2>/dev/null) || return 1
    docker image inspect "$tag" >/dev/null 2>&1
}

for need in "$@"; do
    case "$need" in
    venv)
        python=${PYTHON:-python3}
        if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "host-deps: gpuwarden needs Python >= 3.11 and '$python' is not that: install" \
                "one and run make PYTHON=/path/to/python3.11 (or newer)" >&2
            exit 1
        fi
        if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
            if [ "$("$python" -c 'import sys; print(sys.base_prefix)')" != /usr ]; then
                echo "host-deps: '$python' cannot make a venv (no ensurepip) and is not the" \
                    "system's python3: run make PYTHON=/usr/bin/python3" >&2
                exit 1
            fi
            packages+=(python3-venv)
            why+=("$python cannot make the .venv without it")
        fi
        ;;
    debootstrap)
        if ! command -v debootstrap >/dev/null 2>&1 \
            && docker info >/dev/null 2>&1 && ! image_built; then
            packages+=(debootstrap)
            why+=("debootstrap builds the cluster image")
        fi
        ;;
    lua)
        if ! command -v lua5.1 >/dev/null 2>&1; then
            packages+=(lua5.1 lua-filesystem)
            why+=("the unit tests run plugins/job_submit.lua under Lua 5.1")
        elif ! lua5.1 -e 'require "lfs"' >/dev/null 2>&1; then
            packages+=(lua-filesystem)
            why+=("job_submit.lua checks its snapshot with Lua's lfs")
        fi
        ;;
    chromium)
        if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
            packages+=(chromium)
            why+=("the unit tests render the report page in headless chromium")
        fi
        ;;
    promtool)
        if ! command -v promtool >/dev/null 2>&1; then
            tools_only+=(prometheus)
            why+=("the unit tests check the alert rules and the dashboard with promtool")
        fi
        ;;
    *)
        echo "host-deps: unknown need '$need' (known: venv, debootstrap, lua, chromium," \
            "promtool)" >&2
        exit 2
        ;;
    esac
done

[ "${#packages[@]}" -eq 0 ] && [ "${#tools_only[@]}" -eq 0 ] && exit 0

printf -v reasons '%s; ' "${why[@]}"
reasons=${reasons%; }
all=("${packages[@]}" "${tools_only[@]}")
commands=()
[ "${#packages[@]}" -eq 0 ] || commands+=("apt-get install -y ${packages[*]}")
[ "${#tools_only[@]}" -eq 0 ] || commands+=("apt-get install -y --no-install-recommends ${tools_only[*]}")
if ! command -v apt-get >/dev/null 2>&1; then
    echo "host-deps: missing ${all[*]} ($reasons) and this is not Debian/Ubuntu (no" \
        "apt-get): install them with your package manager, then rerun" >&2
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    printf -v run 'sudo %s && ' "${commands[@]}"
    echo "host-deps: missing ${all[*]} ($reasons); run as root:" "${run% && }" >&2
    exit 1
fi
echo "host-deps: installing ${all[*]} with apt-get ($reasons)"
# A third-party apt source being unreachable must not stop us; the install below is checked.
apt-get update -qq || true
if [ "${#packages[@]}" -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
if [ "${#tools_only[@]}" -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${tools_only[@]}" >/dev/null
    # Debian starts and enables the package's daemon (Prometheus on :9090) where systemd runs.
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        for unit in "${tools_only[@]}"; do
            systemctl disable --now "$unit.service" >/dev/null 2>&1 || true
        done
    fi
fi
