#!/usr/bin/env bash
# `make run-redis`: a throwaway redis-server in the foreground (Ctrl+C stops it), on
# 127.0.0.1:$REDIS_PORT (default 6379), nothing kept on disk.
#
# Debian and Ubuntu start their own redis-server on 6379 when the package is installed.
# If that port is taken, this one takes a free port instead and says which, with the
# REDIS_URL to give the worker and the producer.
set -euo pipefail

port=${REDIS_PORT:-6379}
taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if taken "$port"; then
  wanted=$port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  echo "port $wanted is taken (the OS's own redis-server?); using $port instead" >&2
fi
echo "redis-server on 127.0.0.1:$port, nothing kept on disk; Ctrl+C stops it" >&2
if [[ $port != 6379 ]]; then
  echo "  REDIS_URL=redis://127.0.0.1:$port/0 make run-worker" >&2
fi
exec redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no
