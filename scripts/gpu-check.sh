#!/usr/bin/env bash
# make gpu-check: the CUDA tests and a short GPU benchmark, on a single-GPU host with no
# network, using the host's own python3 and PyTorch (never pip-installing torch).
# Needs .gpu-check/ from `make gpu-check-prepare` (wheels and redis-server).
#
# Writes $GPU_CHECK_OUT/report.json (default .gpu-check/out), plus pytest.xml,
# pytest.log and redis.log there. Exit status: 0 when the tests passed and the benchmark
# ran; 1 otherwise (the report says what failed).
#
#   GPU_CHECK_OUT     where the report goes
#   PYTHON            the interpreter (default python3)
#   GPU_CHECK_MODEL / _BATCH / _PRECISION / _COMPILE / _DECODE / _SECONDS
#                     benchmark settings (resnet50 / 64 / auto / auto / cpu / 40)
#   GPU_CHECK_TEST_TIMEOUT_S / GPU_CHECK_BENCH_TIMEOUT_S   phase limits (220 / 220 s)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GC="$ROOT/.gpu-check"
OUT=${GPU_CHECK_OUT:-$GC/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [[ ! -d $GC/wheels || ! -f $GC/redis/redis-server ]]; then
  echo "gpu-check: $GC is not prepared: run 'make gpu-check-prepare' where there is network" >&2
  exit 2
fi

# 1. Carried wheels into a private site folder (no index, no deps, nothing downloaded).
if [[ ! -f $GC/site/.installed ]] || [[ -n $(find "$GC/wheels" -newer "$GC/site/.installed" -name '*.whl') ]]; then
  rm -rf "$GC/site"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --target "$GC/site" "$GC"/wheels/*.whl || { echo "gpu-check: wheel install failed" >&2; exit 2; }
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

"$PY" -c 'import torch; print("gpu-check: torch", torch.__version__, "cuda", torch.version.cuda,
  "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")'

# 3. The CUDA tests (the CPU suite runs in CI).
timeout "${GPU_CHECK_TEST_TIMEOUT_S:-220}" "$PY" -m pytest -m cuda \
  tests/test_cuda.py tests/test_gpu_decode.py tests/test_doctor.py -q -p no:cacheprovider \
  -o addopts="" --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
TESTS_RC=${PIPESTATUS[0]}

# 4. The benchmark; it writes report.json whatever happens inside it.
timeout -k 20 "${GPU_CHECK_BENCH_TIMEOUT_S:-220}" "$PY" -m worker.gpu_check \
  --out "$OUT" --junit "$OUT/pytest.xml" --redis-url "$REDIS_URL"
BENCH_RC=$?
if [[ ! -f $OUT/report.json ]]; then
  echo "{\"error\": \"gpu_check exited $BENCH_RC without a report\", \"tests_rc\": $TESTS_RC}" > "$OUT/report.json"
fi

echo "gpu-check: tests rc=$TESTS_RC, benchmark rc=$BENCH_RC, report: $OUT/report.json"
[[ $TESTS_RC -eq 0 && $BENCH_RC -eq 0 ]]
