"""`python -m worker.docs_gen [--check]`: write the reference pages, or with --check
exit 1 naming those that differ from what would be written."""

from __future__ import annotations

import sys

from worker import docs_gen


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: python -m worker.docs_gen [--check]", file=sys.stderr)
        return 2
    if argv == ["--check"]:
        stale = docs_gen.stale()
        for path in stale:
            print(f"{path.relative_to(docs_gen.ROOT)} is out of date", file=sys.stderr)
        if stale:
            print(f"run: {docs_gen.FIX_COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in docs_gen.write_all():
        print(f"wrote {path.relative_to(docs_gen.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
