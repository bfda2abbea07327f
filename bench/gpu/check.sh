#!/usr/bin/env bash
# The GPU check: CUDA workers under elasticd through crash, hang, in-process restart,
# warm starts and GPU binding, in one command (bench/README.md, "GPU check").
#
#   bash bench/gpu/check.sh [--out DIR] [--python PATH] [--wheels DIR] [--cpu]
#                           [--only STEP,...] [--timeout STEP=S]... [--budget S] [--keep-work]
#
#   --out DIR        where summary.txt, results.json and logs.tar.gz go (default: a new
#                    temp dir); nothing else is written there
#   --python PATH    the interpreter for the daemon, elasticctl, the jobs and torchrun
#                    (default: python3; with --cpu, the project's, scripts/python.sh)
#   --wheels DIR     install DIR/*.whl into the run's folder first (pip --no-index
#                    --no-deps --target) and put it first on the daemon's PYTHONPATH
#                    (default: .whl/ in the repository when it exists and not --cpu;
#                    --no-wheels: none); pip missing, they are unzipped there instead
#   --cpu            the dry run: the same steps with gloo on CPU tensors and a fake
#                    one-GPU inventory; what needs CUDA is SKIP with the reason
#   --only STEPS     a comma list of: e2e crash inprocess hang template snapshot
#   --timeout S=N    one step's limit in seconds (default: LIMIT below; x3 with --cpu)
#   --budget S       the whole run's limit (default 440 s; 1200 s with --cpu): a step
#                    gets at most what is left, a step with under 20 s left is SKIP
#   --keep-work      keep the work folder (its path is printed) instead of removing it
#
# Every step runs in its own process under its own timeout (one that hangs costs its
# timeout, the next steps still run); after each, whatever the step left running is
# killed and the GPU must be idle again. Exit status: 0 when no check failed.
set -u
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
STEPS=(e2e crash inprocess hang template snapshot)
declare -A LIMIT=([e2e]=100 [crash]=150 [inprocess]=140 [hang]=120 [template]=170
                  [snapshot]=90)
declare -A GIVEN=()   # steps whose limit --timeout set: not scaled for --cpu
OUT="" PY="" WHEELS="" CPU=0 ONLY="" BUDGET="" KEEP=0 NO_WHEELS=0

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --no-wheels) NO_WHEELS=1; shift ;;
        --cpu) CPU=1; shift ;;
        --only) ONLY="$2"; shift 2 ;;
        --timeout) LIMIT[${2%%=*}]="${2#*=}"; GIVEN[${2%%=*}]=1; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --keep-work) KEEP=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "check.sh: unknown argument $1" >&2; usage 2 ;;
    esac
done
for s in "${!LIMIT[@]}"; do
    if [[ ! " ${STEPS[*]} " =~ " $s " ]] || ! [[ "${LIMIT[$s]}" =~ ^[0-9]+$ ]]; then
        echo "check.sh: --timeout $s=${LIMIT[$s]}: want STEP=SECONDS, STEP one of ${STEPS[*]}" >&2
        exit 2
    fi
done
if [ -n "$ONLY" ]; then
    for s in ${ONLY//,/ }; do
        [[ " ${STEPS[*]} " =~ " $s " ]] || { echo "check.sh: --only $s: no such step" >&2; exit 2; }
    done
fi

SCALE=1 CPUFLAG=""
if [ "$CPU" = 1 ]; then
    SCALE=3 CPUFLAG="--cpu"
    [ -n "$PY" ] || PY="$(bash "$REPO/scripts/python.sh")"
    [ -n "$BUDGET" ] || BUDGET=1200
else
    [ -n "$BUDGET" ] || BUDGET=440
    if [ -z "$WHEELS" ] && [ "$NO_WHEELS" = 0 ] && [ -d "$REPO/.whl" ]; then WHEELS="$REPO/.whl"; fi
fi
[ -n "$PY" ] || PY=python3
PY="$(command -v "$PY" || echo "$PY")"
START=$SECONDS
WORK="$(mktemp -d /tmp/gck.XXXXXX)"   # short: the daemons' unix sockets live under it
chmod 755 "$WORK"
[ -n "$OUT" ] || OUT="$(mktemp -d /tmp/gpucheck-out.XXXXXX)"
mkdir -p "$OUT" "$WORK/results"
OUT="$(cd "$OUT" && pwd)"
echo "check.sh: output $OUT, work $WORK, python $PY, $([ "$CPU" = 1 ] && echo '--cpu dry run' || echo GPU)"

export GPUCHECK_TIMEOUT_SCALE="$SCALE" PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
SITE=""
if [ -n "$WHEELS" ]; then
    SITE="$WORK/site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl \
            >"$WORK/pip.log" 2>&1; then
        echo "check.sh: pip could not install $WHEELS/*.whl (last lines of $WORK/pip.log" \
             "below); unpacking them with zipfile instead"
        tail -n 5 "$WORK/pip.log"
        "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1])
                  for w in sys.argv[2:]]" "$SITE" "$WHEELS"/*.whl
    fi
fi
export PYTHONPATH="${SITE:+$SITE:}$REPO/daemon:$REPO/ctl${PYTHONPATH:+:$PYTHONPATH}"
RUN=("$PY" "$REPO/bench/gpu/run.py")
timeout -k 5 120 "${RUN[@]}" versions --work "$WORK" $CPUFLAG 2>&1 | tee "$WORK/versions.log"

for s in "${STEPS[@]}"; do
    if [ -n "$ONLY" ] && [[ ! ",$ONLY," == *",$s,"* ]]; then continue; fi
    left=$(( BUDGET - (SECONDS - START) - 20 ))
    limit=$(( LIMIT[$s] * ${GIVEN[$s]:-$SCALE} ))
    if [ "$left" -lt 20 ]; then
        "${RUN[@]}" record "$s" --work "$WORK" --status SKIP \
            --note "no time left in the run's --budget ${BUDGET}s"
        continue
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== step $s (limit ${limit}s; $(( SECONDS - START ))s into the run) =="
    mkdir -p "$WORK/$s"
    t0=$SECONDS
    # The step and all it starts carry ELASTICD_GPU_CHECK: what the sweep ends after it.
    timeout -k 10 "$limit" env ELASTICD_GPU_CHECK="$WORK" "${RUN[@]}" step "$s" \
        --work "$WORK" $CPUFLAG 2>&1 \
        | tee "$WORK/$s/step.log"
    rc=${PIPESTATUS[0]}
    took=$(( SECONDS - t0 ))
    echo "$rc $took $limit" > "$WORK/results/$s.meta"
    if [ "$rc" -ne 0 ] || [ ! -s "$WORK/results/$s.json" ]; then
        why="exit $rc"; { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && why="timed out at ${limit}s"
        "${RUN[@]}" record "$s" --work "$WORK" --status FAIL \
            --note "the step $why after ${took}s (rows above it are what it finished); see $s/step.log"
    fi
    timeout -k 5 60 "${RUN[@]}" sweep --work "$WORK" $CPUFLAG 2>&1 | tee -a "$WORK/$s/step.log"
done

"${RUN[@]}" summary --work "$WORK" --out "$OUT"
rc=$?
echo "total: $(( SECONDS - START ))s" | tee -a "$OUT/summary.txt"
"${RUN[@]}" pack --work "$WORK" --out "$OUT"
if [ "$KEEP" = 1 ]; then echo "check.sh: work kept in $WORK"; else rm -rf "$WORK"; fi
echo "check.sh: summary $OUT/summary.txt, logs $OUT/logs.tar.gz; exit $rc"
exit "$rc"
