#!/usr/bin/env bash
# make gpu-check: every CUDA test and a short GPU benchmark, judged claim by claim, on a
# single-GPU host with no network, using the host's own python3 and PyTorch (never
# pip-installing torch). Needs .gpu-check/ from `make gpu-check-prepare`.
#
# How to run it on a bare GPU host:
#
#   make gpu-check-prepare      # here, with network: fills .gpu-check/ (ignored, < 64 MiB)
#   # carry .gpu-check/ with the checkout to the GPU host; there, in the checkout:
#   GPU_CHECK_OUT="$OUT" make gpu-check PYTHON=python3; echo "exit $?"
#   # (or, without make: GPU_CHECK_OUT="$OUT" PYTHON=python3 bash scripts/gpu-check.sh)
#   # back here: python -m measure gpu-check --judge OUT/report.json
#
# `bash scripts/gpu-check.sh --rehearse` (make gpu-check-rehearse, run by `make test` in an
# environment with only the GPU host's packages, scripts/gpu_host_rehearsal.py) runs the
# steps a GPU host runs before the GPU is needed: the carry installed and verified, the
# carried redis-server started, the CUDA tests collected with this very command line, the
# benchmark's and the verdict's entry points started. Exit 0 when each step passed.
#
# Order (most decisive first): preflight (seconds; exit 2 if this host cannot run on its
# GPU at all); then the CUDA tests (`pytest -m cuda` over the modules of
# tests/cuda_tests.txt: each test listed there must run and pass) while the benchmark, started beside them,
# compiles its model (the cold compile overlaps the tests'); once the tests end the
# benchmark measures alone on the GPU: ceiling, pipeline (throughput window, then the sync
# window), GPU decode, then extras if time is left. The tests stop at their limit so that
# the benchmark keeps GPU_CHECK_RESERVE_S; a phase that does not fit is "not measured" and
# fails the check. Last, measure.gpu_check.report adds the test results to report.json
# and judges every rule (measure/gpu_check/rules.py), printing each.
#
# Writes $GPU_CHECK_OUT/report.json (default .gpu-check/out), plus pytest.xml, pytest.log,
# benchmark.log and redis.log there. Exit status: 0 when every rule passed; 1 otherwise;
# 2 when the host cannot run the check at all.
#
#   GPU_CHECK_OUT       where the report goes (any folder)
#   GPU_CHECK_DIR       the prepared carry (default .gpu-check in the checkout)
#   PYTHON              the interpreter (default python3)
#   GPU_CHECK_DEVICE    the CUDA device (cuda:0)
#   GPU_CHECK_BUDGET_S  the whole run, in seconds (480: one 10-minute command holds it)
#   GPU_CHECK_RESERVE_S what the benchmark keeps after the tests (200: its judged phases)
#   GPU_CHECK_MODEL / _BATCH / _PRECISION / _COMPILE / _DECODE / _RESIZE / _SECONDS
#                       benchmark settings (resnet50 / 64 / auto / auto / auto / auto / 15)
set -uo pipefail

START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-480}
RESERVE=${GPU_CHECK_RESERVE_S:-200}
left() { echo $((BUDGET - (SECONDS - START))); }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GC=${GPU_CHECK_DIR:-$ROOT/.gpu-check}
REHEARSE=
[[ ${1:-} == --rehearse ]] && REHEARSE=1
OUT=${GPU_CHECK_OUT:-$GC/out}
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda:0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/report.json" "$OUT/pytest.xml" "$OUT/tests.done"
export PYTHONUNBUFFERED=1

# 0. Can this host run it at all? CUDA for torch, and what triton builds its helpers with.
#    Seconds, before anything is installed; exit 2 with the reason (and report.json).
#    The rehearsal has no GPU: it only runs the preflight's --help.
if [[ -n $REHEARSE ]]; then
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m measure.gpu_check.preflight \
    --help >/dev/null || { echo "gpu-check: FAILED: the preflight does not start" >&2; exit 2; }
else
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m measure.gpu_check.preflight \
    --device "$DEVICE" --out "$OUT" || exit 2
fi

if [[ ! -d $GC/wheels || ! -f $GC/redis/redis-server ]]; then
  echo "gpu-check: FAILED: $GC is not prepared: run 'make gpu-check-prepare' where there is network" >&2
  exit 2
fi

# 1. Carried wheels into a private site folder (no index, no deps, nothing downloaded),
#    then proven: each wheel installed at its version and each of its modules importing
#    from that folder (measure/gpu_check/carry.py). A site that proves itself is kept;
#    one that does not (an interrupted install, a carry that kept a stamp but not the
#    files, a newer wheel) is installed again and must prove itself then.
export PYTHONPATH="$GC/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
verify_carry() { "$PY" -m measure.gpu_check.carry --site "$GC/site" --wheels "$GC/wheels" "$@"; }
if [[ ! -d $GC/site || -n $(find "$GC/wheels" -newer "$GC/site" -name '*.whl' 2>/dev/null) ]] \
  || ! verify_carry --quiet >/dev/null 2>&1; then
  rm -rf "$GC/site"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$GC/site" "$GC"/wheels/*.whl || { echo "gpu-check: FAILED: wheel install failed" >&2; exit 2; }
fi
verify_carry || { echo "gpu-check: FAILED: the carried wheels do not import (above)" >&2; exit 2; }

# 2. The carried redis-server, through a wrapper so that its libraries never shadow the
#    ones Python and PyTorch load. The tests start their own servers through PATH.
mkdir -p "$GC/bin"
chmod u+x "$GC/redis/redis-server" "$GC/redis/redis-cli" 2>/dev/null || true
cat > "$GC/bin/redis-server" <<WRAP
#!/usr/bin/env bash
LD_LIBRARY_PATH="$GC/redis" exec "$GC/redis/redis-server" "\$@"
WRAP
chmod +x "$GC/bin/redis-server"
export PATH="$GC/bin:$PATH"

PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$OUT" --logfile "$OUT/redis.log" &
REDIS_PID=$!
BENCH_PID=
cleanup() {
  [[ -n $BENCH_PID ]] && kill "$BENCH_PID" 2>/dev/null
  kill "$REDIS_PID" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 100); do
  "$PY" -c "import redis,sys; redis.Redis(port=$PORT).ping()" 2>/dev/null && break
  sleep 0.1
done
"$PY" -c "import redis; redis.Redis(port=$PORT).ping()" 2>/dev/null \
  || { echo "gpu-check: FAILED: the carried redis-server does not answer (see $OUT/redis.log)" >&2; exit 2; }
export REDIS_URL="redis://127.0.0.1:$PORT/0"

# The CUDA tests: the modules of tests/cuda_tests.txt only, so that a module the check does
# not judge (one that needs pyarrow or mkdocs, say) is neither imported nor skipped here.
# Only the carried plugins load: the host's own pytest plugins (built for its pytest, not
# the carried one) could stop pytest before any test.
mapfile -t CUDA_TESTS < <(grep -Ev '^[[:space:]]*(#|$)' tests/cuda_tests.txt)
mapfile -t CUDA_MODULES < <(printf '%s\n' "${CUDA_TESTS[@]%%::*}" | sort -u)
PYTEST=(env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -m cuda "${CUDA_MODULES[@]}"
  -p pytest_asyncio.plugin -p pytest_timeout -p no:cacheprovider -o addopts="")

if [[ -n $REHEARSE ]]; then
  # make gpu-check-rehearse (and make test): the steps above, then what the GPU host would
  # collect and start, without a GPU. Each failure names what the host would lack.
  failed=
  "${PYTEST[@]}" --collect-only -q -rs > "$OUT/collect.log" 2>&1
  COLLECT_RC=$?
  comm -23 <(printf '%s\n' "${CUDA_TESTS[@]}" | sort) <(grep '::' "$OUT/collect.log" | sort) \
    > "$OUT/not-collected.txt"
  comm -13 <(printf '%s\n' "${CUDA_TESTS[@]}" | sort) <(grep '::' "$OUT/collect.log" | sort) \
    > "$OUT/not-listed.txt"
  awk '/ERROR collecting/ { for (i = 1; i <= NF; i++) if ($i ~ /^tests\//) m = $i }
       /while loading conftest/ { match($0, /tests\/[^'"'"']+/); m = substr($0, RSTART, RLENGTH) }
       /No module named/ { match($0, /No module named [^ ]+/);
         print "gpu-check: FAILED: " m " imports " substr($0, RSTART + 16, RLENGTH - 16) \
           ", which the GPU host lacks (carry it: scripts/gpu-host-carry.txt)" }' \
    "$OUT/collect.log" | sort -u >&2
  if [[ $COLLECT_RC -ne 0 ]]; then
    failed=1
    echo "gpu-check: FAILED: collecting the CUDA tests exited $COLLECT_RC ($OUT/collect.log):" >&2
    grep -E '^(ERROR|SKIPPED)|Error' "$OUT/collect.log" | head -n 20 >&2
  fi
  if [[ -s $OUT/not-collected.txt ]]; then
    failed=1
    echo "gpu-check: FAILED: $(wc -l < "$OUT/not-collected.txt") of ${#CUDA_TESTS[@]} listed CUDA tests not collected:" >&2
    head -n 20 "$OUT/not-collected.txt" >&2
  fi
  if [[ -s $OUT/not-listed.txt ]]; then
    failed=1
    echo "gpu-check: FAILED: collected but not in tests/cuda_tests.txt:" >&2
    cat "$OUT/not-listed.txt" >&2
  fi
  # Side by side: each start imports torch.
  declare -A HELP_PID
  for entry in check report; do
    "$PY" -m measure.gpu_check.$entry --help > "$OUT/$entry-help.log" 2>&1 &
    HELP_PID[$entry]=$!
  done
  for entry in check report; do
    wait "${HELP_PID[$entry]}" || {
      failed=1
      echo "gpu-check: FAILED: python -m measure.gpu_check.$entry does not start:" >&2
      tail -n 5 "$OUT/$entry-help.log" >&2
    }
  done
  if [[ -n $failed ]]; then
    echo "gpu-check rehearsal: FAILED, $((SECONDS - START)) s" >&2
    exit 1
  fi
  echo "gpu-check rehearsal: passed: carry verified, redis-server answers," \
    "$(grep -c '::' "$OUT/collect.log") of ${#CUDA_TESTS[@]} CUDA tests collected" \
    "from ${#CUDA_MODULES[@]} modules, entry points start, $((SECONDS - START)) s"
  exit 0
fi

# 3. The benchmark, started now: its start-up (the model's cold compile, 40-90 s for
#    resnet50) runs beside the tests; it measures only once $OUT/tests.done exists. It
#    writes report.json as each phase ends and stops at its deadline, whatever is running.
DEADLINE=$(( $(left) - 10 ))
echo "gpu-check: benchmark started (deadline ${DEADLINE} s; log: $OUT/benchmark.log)"
timeout -k 10 $(( DEADLINE + 15 )) "$PY" -m measure.gpu_check.check --device "$DEVICE" \
  --out "$OUT" --redis-url "$REDIS_URL" --deadline-s "$DEADLINE" \
  --seconds "${GPU_CHECK_SECONDS:-15}" --wait-for "$OUT/tests.done" \
  > "$OUT/benchmark.log" 2>&1 &
BENCH_PID=$!

# 4. Every cuda-marked test in tests/, leaving the benchmark RESERVE seconds. At the limit
#    pytest gets SIGINT, which still writes the results so far to pytest.xml; a test that
#    never ran fails the check. A module that cannot be imported here fails only its own
#    tests (--continue-on-collection-errors), not the whole run.
TEST_LIMIT=$(( $(left) - RESERVE ))
(( TEST_LIMIT < 10 )) && TEST_LIMIT=10
echo "gpu-check: CUDA tests (at most ${TEST_LIMIT} s)"
timeout -s INT -k 10 "$TEST_LIMIT" "${PYTEST[@]}" -q -rs --continue-on-collection-errors \
  --durations=12 --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
TESTS_RC=${PIPESTATUS[0]}
echo "$TESTS_RC" > "$OUT/tests.done"

wait "$BENCH_PID"
BENCH_RC=$?
BENCH_PID=
grep -h '^{"device"' "$OUT/benchmark.log" || tail -n 3 "$OUT/benchmark.log"

# 5. The verdict: the test results added to the report, every rule judged and printed.
"$PY" -m measure.gpu_check.report --out "$OUT" --junit "$OUT/pytest.xml" \
  --tests-rc "$TESTS_RC" --bench-rc "$BENCH_RC"
VERDICT_RC=$?

echo "gpu-check: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC, $((SECONDS - START)) s, report: $OUT/report.json"
if [[ $VERDICT_RC -ne 0 ]]; then
  echo "gpu-check: FAILED (the rules above say which claim and why)" >&2
  exit 1
fi
echo "gpu-check: passed"
