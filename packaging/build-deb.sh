#!/usr/bin/env bash
# Build the elasticd .deb: a Python virtualenv under /opt/elasticd holding
# elasticd and its dependencies (no torch: the daemon never imports it),
# /usr/bin/elasticd and /usr/bin/elasticctl linked into it, the systemd unit,
# and /etc/elasticd/elasticd.toml as a conffile.
#
#   bash packaging/build-deb.sh [OUTDIR]        (default OUTDIR: dist/)
#   sudo apt install ./dist/elasticd_<version>_<arch>.deb
#
# Build on the same Debian release (and so the same /usr/bin/python3.X) as the
# nodes it is for: the virtualenv points at the build machine's interpreter by
# its absolute path, and its compiled dependencies (grpcio, psutil) are built
# for that Python. The package depends on that exact python3.X package.
#
# Environment:
#   PYTHON   interpreter the venv is made from (default: /usr/bin/python3, which
#            must be Debian's own; needs python3-venv). Not a pyenv/conda one:
#            the installed package would point at a path the nodes don't have.
#   PIP_*    passed on to pip (e.g. PIP_INDEX_URL for a mirror).
#
# Needs: dpkg-deb (package dpkg), python3-venv, network or a pip index for the
# dependencies; python3-pip makes it faster. Runs as any user (file ownership in
# the package is root:root).
# Prints the path of the .deb on its last line.
set -euo pipefail
umask 022

say() { echo "build-deb.sh: $*" >&2; }

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PKG="$REPO/packaging"
OUTDIR="$(mkdir -p "${1:-$REPO/dist}" && cd "${1:-$REPO/dist}" && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
PREFIX=/opt/elasticd

command -v dpkg-deb >/dev/null || { say "needs dpkg-deb (Debian's dpkg)"; exit 1; }
[ -x "$PYTHON" ] || { say "no interpreter at $PYTHON (set PYTHON)"; exit 1; }
# The venv's python links to this path; resolve /usr/bin/python3 -> python3.11
# so the link and the Depends: name the same interpreter.
PYTHON="$(readlink -f "$PYTHON")"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$PYTHON" in
    /usr/bin/python3.*) ;;
    *) say "warning: $PYTHON is not Debian's /usr/bin/python3.X; the package will only" \
           "work where $PYTHON exists";;
esac
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null ||
    { say "$PYTHON cannot make virtualenvs: apt-get install python3-venv"; exit 1; }

VERSION="$("$PYTHON" -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$REPO/pyproject.toml")"
ARCH="$(dpkg --print-architecture)"
DEB="$OUTDIR/elasticd_${VERSION}_${ARCH}.deb"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
ROOT="$STAGE/root"
VENV="$ROOT$PREFIX"

say "virtualenv at $PREFIX from $PYTHON ($PYVER)"
# With a pip that can install into another interpreter (pip >= 22.3, Debian's
# python3-pip is 23), the venv needs no pip of its own, which saves seconds.
if "$PYTHON" -m pip --python "$PYTHON" --version >/dev/null 2>&1; then
    "$PYTHON" -m venv --without-pip "$VENV"
    PIP=("$PYTHON" -m pip --python "$VENV/bin/python")
else
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip)
fi
# The project is built from a copy, so the work tree gets no build/ or egg-info.
SRC="$STAGE/src"
mkdir -p "$SRC"
tar -C "$REPO" --exclude=.git --exclude=build --exclude=dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.venv --exclude='*.deb' --exclude=.pytest_cache \
    -cf - pyproject.toml README.md daemon ctl | tar -C "$SRC" -xf -
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    "${PIP[@]}" install --quiet --no-compile --use-pep517 "$SRC"
# No installer leftovers the package doesn't need.
rm -rf "$VENV"/lib/python*/site-packages/{pip,pip-*.dist-info,setuptools,setuptools-*.dist-info,_distutils_hack,distutils-precedence.pth}
rm -f "$VENV"/bin/pip* "$VENV"/bin/activate* "$VENV"/bin/Activate.ps1
# PEP 610's record of where it was installed from: the temp copy, meaningless later.
rm -f "$VENV"/lib/python*/site-packages/elasticd-*.dist-info/direct_url.json
if "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    say "torch ended up in the daemon's virtualenv; it must not be a dependency"; exit 1
fi

# The venv was made at $VENV; it will live at $PREFIX. Fix the paths it wrote
# down: script shebangs, and the source paths compiled into .pyc files.
for f in "$VENV"/bin/*; do
    if [ -f "$f" ] && [ ! -L "$f" ] && head -c 2 "$f" | grep -q '^#!'; then
        sed -i "1s|^#!$VENV/|#!$PREFIX/|" "$f"
    fi
done
sed -i "s|$VENV|$PREFIX|g" "$VENV/pyvenv.cfg"
if grep -rIl --exclude-dir=__pycache__ "$STAGE" "$VENV" >/dev/null; then
    say "build paths left in: $(grep -rIl --exclude-dir=__pycache__ "$STAGE" "$VENV" | head -5)"
    exit 1
fi
"$VENV/bin/python" -m compileall -q -j 0 -s "$ROOT" -p / "$VENV/lib" >/dev/null

install -d "$ROOT/usr/bin"
ln -s "$PREFIX/bin/elasticd" "$ROOT/usr/bin/elasticd"
ln -s "$PREFIX/bin/elasticctl" "$ROOT/usr/bin/elasticctl"
install -D -m 0644 "$REPO/systemd/elasticd.service" "$ROOT/lib/systemd/system/elasticd.service"
install -D -m 0644 "$PKG/elasticd.toml" "$ROOT/etc/elasticd/elasticd.toml"
install -D -m 0644 "$REPO/README.md" "$ROOT/usr/share/doc/elasticd/README.md"
install -D -m 0644 "$PKG/copyright" "$ROOT/usr/share/doc/elasticd/copyright"
for f in "$REPO"/monitoring/*; do  # Prometheus rules, Grafana dashboard
    [ -f "$f" ] && install -D -m 0644 "$f" "$ROOT/usr/share/elasticd/monitoring/$(basename "$f")"
done

install -d "$ROOT/DEBIAN"
install -m 0644 "$PKG/debian/conffiles" "$ROOT/DEBIAN/conffiles"
for script in postinst prerm postrm; do
    install -m 0755 "$PKG/debian/$script" "$ROOT/DEBIAN/$script"
done
SIZE_KB="$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)"
cat > "$ROOT/DEBIAN/control" <<EOF
Package: elasticd
Version: $VERSION
Architecture: $ARCH
Maintainer: elasticd developers <elasticd@localhost>
Installed-Size: $SIZE_KB
Depends: python$PYVER, adduser
Section: admin
Priority: optional
Description: node daemon for elastic, fault-tolerant PyTorch training
 One elasticd runs on every training node under systemd; elasticctl submits
 and watches jobs over a local unix socket. Training scripts written for
 torchrun run unchanged. Python and its dependencies are bundled in a
 virtualenv under /opt/elasticd; torch is not (the workers bring their own).
EOF

rm -f "$DEB"
# gzip: several times faster to build than xz for a few MB more.
dpkg-deb --root-owner-group -Zgzip -z6 --build "$ROOT" "$DEB" >/dev/null
say "built $(du -h "$DEB" | cut -f1) package"
echo "$DEB"
