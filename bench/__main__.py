"""`kvbridge bench <name> ...` (or `python -m kvbridge.bench <name> ...`): the benchmarks, each writing JSON."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "transfer": "kvbridge.bench.transfer",
    "plan": "kvbridge.bench.plan",
    "soak": "kvbridge.bench.soak",
    "control": "kvbridge.bench.control",
    "prefix": "kvbridge.bench.prefix",
    "vllm": "kvbridge.bench.vllm",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print("usage: kvbridge bench {" + "|".join(BENCHES) + "} [--json PATH] ...", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
