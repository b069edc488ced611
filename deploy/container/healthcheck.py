"""Container health check: GET /live on the worker's metrics port (on each process's port,
GPUFEED_METRICS_PORT + i, with GPUFEED_PROCESSES > 1).

Exit status 0 when /live answers 2xx, or when GPUFEED_METRICS_PORT is unset or 0 (the
health endpoints are off, so there is nothing to ask); 1 otherwise. Standard library
only, so the image needs no curl. The port is read from the environment: set it there,
not with the --metrics-port flag.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def check(env: dict[str, str] | None = None) -> tuple[bool, str]:
    env = dict(os.environ) if env is None else env
    raw = env.get("GPUFEED_METRICS_PORT", "").strip()
    try:
        port = int(raw or "0")
    except ValueError:
        return False, f"GPUFEED_METRICS_PORT is not a port: {raw!r}"
    if port == 0:
        return True, "metrics port off: nothing to check"
    raw = env.get("GPUFEED_PROCESSES", "").strip()
    try:
        processes = max(1, int(raw or "1"))
    except ValueError:
        return False, f"GPUFEED_PROCESSES is not a number: {raw!r}"
    # With several worker processes, process i serves its endpoints on port + i: all of
    # them must be live.
    messages = []
    for i in range(processes):
        ok, message = check_port(port + i)
        if not ok:
            return False, message
        messages.append(message)
    return True, "; ".join(messages)


def check_port(port: int) -> tuple[bool, str]:
    url = f"http://127.0.0.1:{port}/live"
    # No proxy, even if HTTP_PROXY is set for the worker's own downloads.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT_S) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except OSError as exc:  # URLError, refused, timeout
        return False, f"{url}: {exc}"
    return 200 <= status < 300, f"{url}: HTTP {status}"


def main() -> int:
    ok, message = check()
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
