#!/usr/bin/env bash
# make gpu-check: the CUDA tests and a short GPU benchmark, on a single-GPU host with no
# network, using the host's own python3 and PyTorch (never pip-installing torch).
# Needs .gpu-check/ from `make gpu-check-prepare` (wheels and redis-server).
#
# It fails, loudly, whenever it did not really run on the GPU: no CUDA device for torch
# (a driver too old for the wheel, say), no C compiler or Python headers for triton, a CUDA
# test failed or skipped, or the benchmark did not finish. The whole run keeps to a time
# budget, and report.json holds what was measured even when a phase is cut.
#
# Writes $GPU_CHECK_OUT/report.json (default .gpu-check/out), plus pytest.xml,
# pytest.log and redis.log there. Exit status: 0 when every CUDA test ran and passed and
# the benchmark ran; 1 otherwise; 2 when the host cannot run the check at all.
#
#   GPU_CHECK_OUT       where the report goes
#   PYTHON              the interpreter (default python3)
#   GPU_CHECK_DEVICE    the CUDA device (cuda:0)
#   GPU_CHECK_BUDGET_S  the whole run, in seconds (270)
#   GPU_CHECK_TEST_TIMEOUT_S   at most this for the CUDA tests (110)
#   GPU_CHECK_MODEL / _BATCH / _PRECISION / _COMPILE / _DECODE / _SECONDS
#                       benchmark settings (resnet50 / 64 / auto / auto / cpu / 20)
set -uo pipefail

START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-270}
left() { echo $((BUDGET - (SECONDS - START))); }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GC="$ROOT/.gpu-check"
OUT=${GPU_CHECK_OUT:-$GC/out}
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda:0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/report.json" "$OUT/pytest.xml"

# 0. Can this host run it at all? CUDA for torch, and what triton builds its helpers with.
#    Seconds, before anything is installed; exit 2 with the reason (and report.json).
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m worker.tools.gpu_preflight \
  --device "$DEVICE" --out "$OUT" || exit 2

if [[ ! -d $GC/wheels || ! -f $GC/redis/redis-server ]]; then
  echo "gpu-check: FAILED: $GC is not prepared: run 'make gpu-check-prepare' where there is network" >&2
  exit 2
fi

# 1. Carried wheels into a private site folder (no index, no deps, nothing downloaded).
if [[ ! -f $GC/site/.installed ]] || [[ -n $(find "$GC/wheels" -newer "$GC/site/.installed" -name '*.whl') ]]; then
  rm -rf "$GC/site"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --target "$GC/site" "$GC"/wheels/*.whl || { echo "gpu-check: FAILED: wheel install failed" >&2; exit 2; }
  touch "$GC/site/.installed"
fi
export PYTHONPATH="$GC/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

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
cleanup() { kill "$REDIS_PID" 2>/dev/null; wait "$REDIS_PID" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 100); do
  "$PY" -c "import redis,sys; redis.Redis(port=$PORT).ping()" 2>/dev/null && break
  sleep 0.1
done
export REDIS_URL="redis://127.0.0.1:$PORT/0"

# 3. The CUDA tests (the CPU suite runs in CI), leaving the benchmark at least 150 s. At
#    the limit pytest gets SIGINT, which still writes the results so far to pytest.xml.
TEST_LIMIT=$(( $(left) - 150 ))
(( TEST_LIMIT > ${GPU_CHECK_TEST_TIMEOUT_S:-110} )) && TEST_LIMIT=${GPU_CHECK_TEST_TIMEOUT_S:-110}
(( TEST_LIMIT < 10 )) && TEST_LIMIT=10
echo "gpu-check: CUDA tests (at most ${TEST_LIMIT} s)"
timeout -s INT -k 10 "$TEST_LIMIT" "$PY" -m pytest -m cuda \
  tests/test_cuda.py tests/test_gpu_decode.py tests/test_doctor.py -q -rs -p no:cacheprovider \
  -o addopts="" --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
TESTS_RC=${PIPESTATUS[0]}

# 4. The benchmark, with the rest of the budget; it writes report.json as each phase ends,
#    stops at its deadline, and counts skipped or failed CUDA tests as failures.
DEADLINE=$(( $(left) - 10 ))
(( DEADLINE < 30 )) && DEADLINE=30
echo "gpu-check: benchmark (deadline ${DEADLINE} s)"
timeout -k 10 $(( DEADLINE + 15 )) "$PY" -m worker.tools.gpu_check --device "$DEVICE" \
  --out "$OUT" --junit "$OUT/pytest.xml" --tests-rc "$TESTS_RC" --redis-url "$REDIS_URL" \
  --deadline-s "$DEADLINE"
BENCH_RC=$?
if [[ ! -f $OUT/report.json ]]; then
  echo "{\"error\": \"gpu_check exited $BENCH_RC without a report\", \"tests_rc\": $TESTS_RC}" > "$OUT/report.json"
fi

echo "gpu-check: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC, $((SECONDS - START)) s, report: $OUT/report.json"
if [[ $TESTS_RC -ne 0 || $BENCH_RC -ne 0 ]]; then
  echo "gpu-check: FAILED (the report's verdict says why)" >&2
  exit 1
fi
