#!/usr/bin/env bash
# The project's test command: install what the tests need, then run them.
#   bash scripts/test.sh [PYTEST ARGS...]     e.g. bash scripts/test.sh -m slow -x
# Exits with pytest's own exit status.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest "$@"
