#!/usr/bin/env bash
# Prints the interpreter the project's scripts run: $PYTHON if set, else the
# project virtualenv that scripts/setup.sh makes (.venv/bin/python).
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
else
    echo "$PWD/.venv/bin/python"
fi
