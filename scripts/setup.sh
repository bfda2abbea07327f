#!/usr/bin/env bash
# Install what elasticd needs on a Debian 12 / Ubuntu 24.04 machine; safe to run again.
#   bash scripts/setup.sh [--demo] [--link-commands] [--pip-args]
#   - Python 3.11+ with its venv module: Debian's python3 and python3-venv from
#     apt when the first python3 on PATH is missing or older (a minimal Debian
#     or Ubuntu has none).
#   - a project virtualenv, .venv/ (git-ignored), made with `python3 -m venv`
#     from that python3 (Debian's own /usr/bin/python3 refuses pip installs:
#     PEP 668); if its venv module lacks ensurepip, python3.X-venv from apt.
#   - this repository into it, editable, with its test extras:
#     `.venv/bin/python -m pip install -e ".[test]"`. torch is pinned
#     (torch==2.13.0, pyproject.toml). Which build pip takes depends on where
#     it looks: PyPI's torch for Linux x86_64 is the CUDA build (it pulls
#     about 2.7 GB of nvidia-* packages: a venv of about 4.8 GB); the CPU build
#     (a 192 MB wheel, a venv of about 1 GB) comes from PyTorch's CPU index:
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu adds it to pip's
#     indexes (`--extra-index-url`), where its 2.13.0+cpu outranks PyPI's
#     2.13.0. pip's own settings (pip.conf, PIP_* variables: e.g. a
#     find-links dir holding the CPU wheel) apply as always. The install is
#     skipped when nothing that decides it has changed (pyproject.toml, the
#     interpreter, TORCH_INDEX_URL), so a second run takes about a second. As root, a
#     .venv/ made before from a python3 others cannot run is made again.
#   - for the tests only (not with --demo): etcd (Debian's etcd-server +
#     etcd-client), promtool (prometheus), ip (iproute2) and nft (nftables),
#     each only if its command is missing; the packages' own services are kept
#     from running: the tests start their own servers and want the ports free.
#   --demo           only what scripts/demo.sh needs: Python, the venv, the project.
#   --link-commands  also symlink elasticd and elasticctl from .venv/bin into
#                    /usr/local/bin (root's PATH and everyone's; they run the venv's
#                    Python, so others can use them only if they may enter this clone).
#   --pip-args       print the pip install arguments one per line and exit.
#   PYTHON=/path/to/python overrides the venv: the project is installed into
#   that interpreter's environment instead (it must accept pip installs).
#   scripts/python.sh prints the interpreter the other scripts then use.
# Runs as root, or through sudo for the apt/systemctl steps. Quiet unless a
# step fails (then that step's output is shown and the script exits non-zero),
# but for one line naming the torch build after an install.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup.sh: $*" >&2; }

DEMO_ONLY=0 LINK_COMMANDS=0 PIP_ARGS_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --demo) DEMO_ONLY=1 ;;
        --link-commands) LINK_COMMANDS=1 ;;
        --pip-args) PIP_ARGS_ONLY=1 ;;
        *) say "unknown argument: $arg (see the top of scripts/setup.sh)"; exit 2 ;;
    esac
done

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

APT_UPDATED=0
# apt_get_install PACKAGE...: apt-get update (once per run), then install them.
apt_get_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        quietly as_root apt-get update || return
        APT_UPDATED=1
    fi
    quietly as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "$@"
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
    apt_get_install "$@" || rc=$?
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

# python_ok PY: PY runs and is Python 3.11 or newer.
python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

# others_can_run PY: an unprivileged user (nobody) can start PY's interpreter. Asked as
# root only: the tests and the daemon start workers with the venv's python as other
# users, and a venv's python is a link to its base (one under /root, e.g. pyenv's, is
# root's alone).
others_can_run() {
    [ "$(id -u)" -eq 0 ] || return 0
    "$1" - <<'EOF' >/dev/null 2>&1
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
        os.execv(sys.executable, [sys.executable, "-c", ""])
    finally:
        os._exit(1)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
EOF
}

# base_python: BASE_PYTHON := the first python3 on PATH (as root: the first one others
# can run too, else Debian's /usr/bin/python3), made 3.11+ with apt (Debian's python3
# and python3-venv) when it is missing or older.
BASE_PYTHON=""
base_python() {
    local base
    base="$(command -v python3 || true)"
    if [ -n "$base" ] && python_ok "$base" && ! others_can_run "$base" &&
            [ -x /usr/bin/python3 ] && python_ok /usr/bin/python3 &&
            others_can_run /usr/bin/python3; then
        say "$base is root's alone (others cannot run it); the venv uses /usr/bin/python3"
        base=/usr/bin/python3
    fi
    if [ -n "$base" ] && python_ok "$base"; then
        BASE_PYTHON="$base"
        return 0
    fi
    if [ -n "$base" ]; then
        say "$base is $("$base" --version 2>&1); elasticd needs Python 3.11+"
    fi
    say "installing python3 and python3-venv with apt-get"
    apt_get_install python3 python3-venv || return
    hash -r
    base="$(command -v python3 || true)"
    if [ -z "$base" ] || ! python_ok "$base"; then
        say "python3 is still missing or older than 3.11 after apt-get (${base:-none}); install" \
            "Python 3.11+ (Debian 12 and Ubuntu 24.04 have it) and put it first on PATH," \
            "or name one with PYTHON=/path/to/python"
        return 1
    fi
    BASE_PYTHON="$base"
}

# make_venv: .venv/ from the base python3, installing python3-venv first when
# the base interpreter cannot make one (Debian splits ensurepip out).
make_venv() {
    local base
    base_python || return
    base="$BASE_PYTHON"
    if "$base" -m venv --clear .venv >/dev/null 2>&1; then
        return 0
    fi
    rm -rf .venv
    local ver
    ver="$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    say "$base cannot make a virtualenv; installing python$ver-venv with apt-get"
    apt_get_install "python$ver-venv" || apt_get_install python3-venv
    quietly "$base" -m venv --clear .venv
}

# pip_args: what follows `pip` for the project's install, one per line.
pip_args() {
    printf '%s\n' install -e ".[test]"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        printf '%s\n' --extra-index-url "$TORCH_INDEX_URL"
    fi
}

# torch_build PY: one line saying which torch build PY has.
torch_build() {
    local version
    version="$("$1" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" ||
        return 0
    case "$version" in
        *+cpu*) say "torch $version installed: the CPU build" ;;
        *) say "torch $version installed: $(
            if "$1" -c 'import importlib.metadata as m, sys; sys.exit(not any(
                (d.metadata["Name"] or "").startswith("nvidia-") for d in m.distributions()))' \
                    2>/dev/null; then
                echo "a CUDA build (with nvidia-* packages; for the CPU build:" \
                     "rm -rf .venv and set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
            else
                echo "no nvidia-* packages came with it"
            fi)" ;;
    esac
}

install_python_packages() {
    local py stamp want
    if [ -n "${PYTHON:-}" ]; then
        py="$PYTHON"
        command -v "$py" >/dev/null 2>&1 || { say "PYTHON=$py not found"; return 1; }
        stamp=""
    else
        if [ -x .venv/bin/python ] && ! others_can_run "$(readlink -f .venv/bin/python)" &&
                others_can_run /usr/bin/python3 && python_ok /usr/bin/python3; then
            # Made before from a python3 only root can run (pyenv's under /root): the
            # workers of other users could not start; make it again from one they can.
            say ".venv/ was made from $(readlink -f .venv/bin/python), which others cannot run;" \
                "making it again"
            rm -rf .venv
        fi
        if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c '' >/dev/null 2>&1; then
            say "making the project virtualenv in .venv/"
            make_venv
        fi
        py=.venv/bin/python
        stamp=.venv/.elasticd-installed
    fi
    # What decides the install: the declared dependencies, the interpreter, the index.
    want="$(cat pyproject.toml; "$py" -c 'import sys; print(sys.executable, sys.version)'
            echo "${TORCH_INDEX_URL:-}")"
    want="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
    if [ -n "$stamp" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    say "installing elasticd and its test extras into $("$py" -c 'import sys; print(sys.prefix)') (first time: a few minutes)"
    local args
    mapfile -t args < <(pip_args)
    PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        quietly "$py" -m pip "${args[@]}"
    [ -z "$stamp" ] || printf '%s\n' "$want" >"$stamp"
    torch_build "$py"
}

# link_commands: /usr/local/bin/elasticd and elasticctl -> the venv's.
link_commands() {
    local bin="$PWD/.venv/bin" name
    [ -z "${PYTHON:-}" ] || bin="$(dirname "$(command -v "$PYTHON")")"
    for name in elasticd elasticctl; do
        [ -x "$bin/$name" ] || { say "no $bin/$name to link"; return 1; }
        as_root ln -sfn "$bin/$name" "/usr/local/bin/$name"
    done
    say "linked /usr/local/bin/elasticd and /usr/local/bin/elasticctl to $bin/"
}

if [ "$PIP_ARGS_ONLY" -eq 1 ]; then
    pip_args
    exit 0
fi
if [ "$DEMO_ONLY" -eq 0 ]; then
    install_etcd
    install_promtool
    install_netns_tools
fi
install_python_packages
if [ "$LINK_COMMANDS" -eq 1 ]; then
    link_commands
fi
