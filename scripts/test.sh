#!/usr/bin/env bash
# The project's test command: install what the tests need (scripts/setup.sh:
# etcd and promtool from apt, the project into .venv/), then run pytest from the venv.
#   bash scripts/test.sh [PYTEST ARGS...]     e.g. bash scripts/test.sh -m slow -x
# Exits with pytest's own exit status.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec "$(bash scripts/python.sh)" -m pytest "$@"
