#!/usr/bin/env bash
# Run one of bench/'s CPU benchmarks on the GPU machine (16 quiet cores, no network):
#
#   bash bench/gpu/bench.sh --wheels .whl --etcd .etcdbin/etcd [--out DIR] -- SCRIPT [ARGS...]
#
# e.g. `-- goodput.py --nodes 3 --spares 1`. The machine has Python and torch but
# not the project's other dependencies nor etcd: --wheels installs DIR/*.whl into a
# folder of the run (bench/gpu/wheels.sh makes them here), --etcd names an etcd
# binary carried with the tree (tests/etcd_server.py finds it through
# ELASTICD_TEST_ETCD). Output goes to stdout and, with --out, to DIR/bench.log.
set -u
WHEELS="" ETCD="" OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --etcd) ETCD="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "bench.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ $# -ge 1 ] || { echo "bench.sh: name a benchmark after --" >&2; exit 2; }
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="$(command -v python3)"
WORK="$(mktemp -d /tmp/gbench.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$WORK/site" "$WHEELS"/*.whl \
        >"$WORK/pip.log" 2>&1 || { tail -n 5 "$WORK/pip.log"; exit 1; }
fi
[ -z "$ETCD" ] || { chmod +x "$ETCD"; export ELASTICD_TEST_ETCD="$(cd "$(dirname "$ETCD")" && pwd)/$(basename "$ETCD")"; }
export PYTHONPATH="${WHEELS:+$WORK/site:}$REPO/daemon:$REPO/ctl${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "bench.sh: $(nproc) CPUs, $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'), load $(cut -d' ' -f1-3 /proc/loadavg)"
script="$1"; shift
cd "$REPO"
if [ -n "$OUT" ]; then
    mkdir -p "$OUT"
    "$PY" "bench/$script" "$@" 2>&1 | tee "$OUT/bench.log"
    exit "${PIPESTATUS[0]}"
fi
exec "$PY" "bench/$script" "$@"
