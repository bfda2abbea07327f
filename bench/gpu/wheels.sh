#!/usr/bin/env bash
# Download into .whl/ the wheels bench/gpu/check.sh installs on a GPU machine with no
# network: the daemon's runtime dependencies (pyproject.toml) and theirs, for CPython 3.12
# on manylinux x86-64, at the versions the project's virtualenv runs here.
#
#   bash bench/gpu/wheels.sh [--dest DIR] [--python-version 3.12]
#
# Run here (PyPI reachable), from anywhere; then carry .whl/ (git-ignored) to the device
# and run `bash bench/gpu/check.sh --wheels .whl --out $OUT` there. python-etcd is
# published as a source archive only: it is built into a pure-Python wheel here. At the
# end the set is installed into a fresh --target for 3.12 (no 3.12 interpreter needed),
# which fails if a wheel does not fit or two versions of one package are in the set.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.whl PYVER=3.12
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        --python-version) PYVER="$2"; shift 2 ;;
        *) echo "wheels.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
PY="$(bash scripts/python.sh)"
# The runtime dependencies and what they pull in (grpcio: typing-extensions;
# cryptography: cffi, pycparser; python-etcd: urllib3, dnspython).
DISTS=(grpcio grpcio-health-checking protobuf cryptography cffi pycparser psutil
       prometheus-client typing-extensions urllib3 dnspython)
PINS=()
for d in "${DISTS[@]}" python-etcd; do
    v="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$d")"
    PINS+=("$d==$v")
done
echo "wheels.sh: ${PINS[*]}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" -d "$TMP/whl" \
    "${PINS[@]:0:${#DISTS[@]}}"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$TMP/whl" "${PINS[-1]}"
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" --target "$TMP/site" \
    "$TMP"/whl/*.whl
rm -rf "$DEST"
mv "$TMP/whl" "$DEST"
ls -1 "$DEST"
echo "wheels.sh: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST; they install" \
     "into a fresh --target for CPython $PYVER"
