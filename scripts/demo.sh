#!/usr/bin/env bash
# The README's first command: install elasticd, start a standalone daemon,
# run the bundled sample training job (2 ranks, gloo on CPU) that crashes
# once on purpose, and show it recovering and finishing.
#   bash scripts/demo.sh            (set DEMO_KEEP=1 to leave the daemon running)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo  # Python, .venv/ and the project; not the tests' etcd & co.
repo="$PWD"
# The project's virtualenv (.venv/bin/python) unless PYTHON says otherwise.
PYTHON="$(bash scripts/python.sh)"

work="$(mktemp -d /tmp/elasticd-demo.XXXXXX)"
sock="$work/control.sock"
export ELASTICD_SOCKET="$sock"
ctl() { "$PYTHON" -m elasticctl "$@"; }

echo "==> starting elasticd --standalone (socket $sock, state $work/state)"
"$PYTHON" -m elasticd --standalone --socket "$sock" --state-dir "$work/state" \
    --metrics-port 0 >"$work/daemon.log" 2>&1 &
daemon=$!
stop_daemon() {
    if [ -z "${DEMO_KEEP:-}" ]; then
        kill -TERM "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
        echo "==> daemon stopped; its log and the job's files are in $work"
        echo "==> to run elasticd and elasticctl yourself: . $repo/.venv/bin/activate" \
             "(or bash scripts/setup.sh --link-commands); see the README's \"Using it\""
    else
        echo "==> daemon still running (pid $daemon): export ELASTICD_SOCKET=$sock"
    fi
}
trap stop_daemon EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
ctl nodes

echo
echo "==> submitting the sample job: 2 ranks, 300 steps, rank 1 crashes at step 150"
cd "$work"
job=$(ctl submit --name sample --nproc-per-node 2 --max-restarts 3 -- \
      "$PYTHON" -m elasticd.examples.train --steps 300 --checkpoint-every 50 --crash-at-step 150)
echo "job id: $job"
rc=0
ctl wait "$job" || rc=$?

echo
echo "==> elasticctl status $job"
ctl status "$job"
echo
echo "==> elasticctl events $job"
ctl events "$job"
echo
echo "==> elasticctl logs $job --rank 0"
ctl logs "$job" --rank 0
echo
echo "==> elasticctl logs $job --rank 1 --tail 8"
ctl logs "$job" --rank 1 --tail 8
exit "$rc"
