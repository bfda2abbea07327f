#!/usr/bin/env bash
# Install what elasticd's tests need on a Debian 12 machine; safe to run again.
#   - etcd (Debian's etcd-server + etcd-client), only if `etcd` is not on PATH;
#     the package's own etcd service is kept from running: the tests start
#     their own etcd servers and want its ports free.
#   - this repository, editable, with its test extras:
#     `$PYTHON -m pip install -e ".[test]"` (PYTHON defaults to python3).
#     torch is pinned in pyproject.toml, so pip takes the CPU wheel found on
#     disk rather than a multi-GB CUDA build. A Debian system python refuses
#     pip installs (PEP 668): point PYTHON at a virtualenv's python then.
# Runs as root, or through sudo for the apt/systemctl steps. Quiet unless a
# step fails; then that step's output is shown and the script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"

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

install_python_packages() {
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        say "$PYTHON not found; install Python 3.11+ (or set PYTHON=/path/to/python)"
        return 1
    fi
    PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        quietly "$PYTHON" -m pip install -e ".[test]"
}

install_etcd
install_promtool
install_python_packages
