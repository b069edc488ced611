#!/usr/bin/env bash
# One worker process per GPU: each sees only its GPU (CUDA_VISIBLE_DEVICES), uses it as
# cuda:0 and joins the consumer group under its own name (<host>-gpu<i>).
#
#   GPUS=0,2   only these GPUs (default: every visible one)
#   PYTHON     the interpreter (default .venv/bin/python, else python3)
#
# With one GPU (or none) it simply becomes that one worker. SIGTERM/SIGINT go to every
# child, and it exits once they all have (non-zero if any failed).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

gpus=()
if [[ -n ${GPUS:-} ]]; then
  IFS=',' read -r -a gpus <<< "${GPUS// /}"
else
  count=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if [[ $count -eq 0 ]]; then
    count=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  fi
  for ((i = 0; i < count; i++)); do gpus+=("$i"); done
fi

if [[ ${#gpus[@]} -le 1 && -z ${GPUS:-} ]]; then
  exec "$PYTHON" -m worker "$@"
fi

host=$(hostname -s 2>/dev/null || hostname)
pids=()
for gpu in "${gpus[@]}"; do
  CUDA_VISIBLE_DEVICES=$gpu GPUFEED_DEVICE=cuda:0 \
    GPUFEED_WORKER_NAME="${GPUFEED_WORKER_NAME_PREFIX:-$host}-gpu$gpu" \
    "$PYTHON" -m worker "$@" &
  pids+=($!)
  echo "run-workers: gpu $gpu -> pid $!" >&2
done

forward() {
  echo "run-workers: $1 -> workers ${pids[*]}" >&2
  kill -s "$1" "${pids[@]}" 2>/dev/null
}
trap 'forward TERM' TERM
trap 'forward INT' INT

status=0
for pid in "${pids[@]}"; do
  # wait returns early (>128) when a trapped signal arrives: wait again for the same child.
  while true; do
    wait "$pid"
    rc=$?
    if [[ $rc -gt 128 ]] && kill -0 "$pid" 2>/dev/null; then continue; fi
    break
  done
  [[ $rc -ne 0 ]] && status=$rc
done
exit "$status"
