#!/usr/bin/env bash
# `make run-redis`: a throwaway redis-server in the foreground (Ctrl+C stops it), on
# 127.0.0.1:$REDIS_PORT (default 6379), nothing kept on disk.
#
# Debian and Ubuntu start their own redis-server on 6379 when the package is installed.
# If that port is taken, this one takes a free port instead. What to use is printed last,
# once the server answers, so that Redis's own banner does not scroll it away.
set -euo pipefail

port=${REDIS_PORT:-6379}
taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# A PONG, not just a connect: the kernel takes connections before Redis serves (and logs
# that it is ready).
answers() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'PING\r\n' >&3 && read -r -t 1 reply <&3 \
    && [[ $reply == +PONG* ]]) 2>/dev/null
}

note=""
if taken "$port"; then
  wanted=$port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  note="port $wanted is taken (the OS's own redis-server?); using $port instead"
fi
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no &
server=$!
# Ctrl+C reaches the server too (same process group); a TERM to this script is passed on.
trap 'kill -TERM "$server" 2>/dev/null || true' TERM
trap '' INT
for _ in $(seq 200); do
  answers "$port" && break
  kill -0 "$server" 2>/dev/null || { wait "$server"; exit $?; }
  sleep 0.05
done
{
  echo
  [[ -n $note ]] && echo "$note"
  echo "redis-server on 127.0.0.1:$port, nothing kept on disk; Ctrl+C stops it. Use:"
  echo "  REDIS_URL=redis://127.0.0.1:$port/0 make run-worker"
} >&2
# `wait` returns early when a trapped signal arrives: wait on until the server is gone.
while kill -0 "$server" 2>/dev/null; do wait "$server" || true; done
