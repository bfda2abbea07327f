#!/usr/bin/env bash
# Install what elasticd's tests need on a Debian 12 machine; safe to run again.
#   - etcd (Debian's etcd-server + etcd-client), only if `etcd` is not on PATH;
#     the package's own etcd service is kept from running: the tests start
#     their own etcd servers and want its ports free.
#   - a project virtualenv, .venv/ (git-ignored), made with `python3 -m venv`
#     from the first python3 on PATH (Debian's own /usr/bin/python3 on a plain
#     Debian 12 / Ubuntu 24.04, which refuses pip installs: PEP 668); if the
#     venv module lacks ensurepip, Debian's python3-venv is installed with apt.
#   - this repository into it, editable, with its test extras:
#     `.venv/bin/python -m pip install -e ".[test]"`. torch is pinned in
#     pyproject.toml, so pip takes the CPU wheel rather than a multi-GB CUDA
#     build. Skipped when nothing that decides the install has changed
#     (pyproject.toml and the interpreter), so a second run takes a second.
#   PYTHON=/path/to/python overrides the venv: the project is installed into
#   that interpreter's environment instead (it must accept pip installs).
#   scripts/python.sh prints the interpreter the other scripts then use.
# Runs as root, or through sudo for the apt/systemctl steps. Quiet unless a
# step fails; then that step's output is shown and the script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup.sh: $*" >&2; }

# Run a command with its output kept aside; show it only if the command fails.
quietly() {
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "failed (exit $rc): $*"
        cat "$log" >&2
    fi
    rm -f "$log"
    return "$rc"
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        say "needs root (or sudo) for: $*"
        return 1
    fi
}

# apt_install BINARY SERVICE PACKAGE...: install the packages unless BINARY is
# already on PATH, never letting the package start SERVICE (policy-rc.d exit
# 101, honoured by invoke-rc.d and deb-systemd-invoke; a policy-rc.d that is
# already there, as in containers, is left alone), and keep SERVICE disabled:
# the tests start their own servers and want the ports free.
apt_install() {
    local binary=$1 service=$2
    shift 2
    if command -v "$binary" >/dev/null 2>&1; then
        return 0
    fi
    say "installing $binary ($*) with apt-get"
    local policy=/usr/sbin/policy-rc.d ours=0
    if [ ! -e "$policy" ]; then
        as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
        ours=1
    fi
    local rc=0
    {
        quietly as_root apt-get update &&
        quietly as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends "$@"
    } || rc=$?
    if [ "$ours" -eq 1 ]; then
        as_root rm -f "$policy"
    fi
    [ "$rc" -eq 0 ] || return "$rc"
    if command -v systemctl >/dev/null 2>&1; then
        if [ -d /run/systemd/system ]; then
            as_root systemctl disable --now "$service.service" >/dev/null 2>&1 || true
        else
            # No systemd running (a container): disabling still works offline.
            as_root systemctl disable "$service.service" >/dev/null 2>&1 || true
        fi
    fi
    command -v "$binary" >/dev/null 2>&1 || { say "$binary still not on PATH after install"; return 1; }
}

# etcd for the cluster tests; promtool (Debian's prometheus package ships it)
# for `promtool check metrics/rules` in the metrics tests.
install_etcd() { apt_install etcd etcd etcd-server etcd-client; }
install_promtool() { apt_install promtool prometheus prometheus; }
# ip/tc and nft for the network-namespace cluster tests (tests/netcluster.py);
# nftables.service stays disabled: it would replace the machine's ruleset.
install_netns_tools() {
    apt_install ip iproute2 iproute2
    apt_install nft nftables nftables
}

# make_venv: .venv/ from the base python3, installing python3-venv first when
# the base interpreter cannot make one (Debian splits ensurepip out).
make_venv() {
    local base
    base="$(command -v python3 || true)"
    if [ -z "$base" ]; then
        say "python3 not found; install Python 3.11+ (apt-get install python3 python3-venv)"
        return 1
    fi
    if "$base" -m venv --clear .venv >/dev/null 2>&1; then
        return 0
    fi
    rm -rf .venv
    local ver
    ver="$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    say "$base cannot make a virtualenv; installing python$ver-venv with apt-get"
    quietly as_root apt-get update
    quietly as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "python$ver-venv" ||
        quietly as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends python3-venv
    quietly "$base" -m venv --clear .venv
}

install_python_packages() {
    local py stamp want
    if [ -n "${PYTHON:-}" ]; then
        py="$PYTHON"
        command -v "$py" >/dev/null 2>&1 || { say "PYTHON=$py not found"; return 1; }
        stamp=""
    else
        if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c '' >/dev/null 2>&1; then
            say "making the project virtualenv in .venv/"
            make_venv
        fi
        py=.venv/bin/python
        stamp=.venv/.elasticd-installed
    fi
    # What decides the install: the declared dependencies and the interpreter.
    want="$(cat pyproject.toml; "$py" -c 'import sys; print(sys.executable, sys.version)')"
    want="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
    if [ -n "$stamp" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    say "installing elasticd and its test extras into $("$py" -c 'import sys; print(sys.prefix)') (first time: a few minutes)"
    PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        quietly "$py" -m pip install -e ".[test]"
    [ -z "$stamp" ] || printf '%s\n' "$want" >"$stamp"
}

install_etcd
install_promtool
install_netns_tools
install_python_packages
