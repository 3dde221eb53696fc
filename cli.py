"""The `kvbridge` command: a thin dispatcher to subcommands that live beside the code they run.

Each subcommand is "module:function"; the function takes the remaining argv and returns an exit code.
Modules are imported only when their subcommand runs, so `kvbridge --help` is instant.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # name: (module:function, one-line help)
    "demo": ("kvbridge.demo:main", "run the end-to-end demo (what `make demo` runs)"),
    "generate": ("kvbridge.executor.generate:main", "run a prompt on the reference executor"),
    "keys": ("kvbridge.transceiver.keys:main", "create a CurveZMQ key pair for the control plane"),
    "bench": ("kvbridge.bench.__main__:main",
              "benchmarks: transfer, plan, control, prefix, soak (kvbridge bench --help)"),
    "serve": ("kvbridge.serving.launcher:main",
              "launch every worker and the router of a serving config (YAML); --check: validate it only"),
    "worker": ("kvbridge.serving.worker:main", "one context or generation worker of a serving config"),
    "router": ("kvbridge.serving.router_cli:main", "the OpenAI-compatible router of a serving config"),
    "verify-layout": ("kvbridge.formatter.cli:main", "check a ctx/gen TP/PP split byte-exact in-process"),
    # agent authors: the TransferAgent conformance suite against your class, as a pass/fail table
    "check-agent": ("kvbridge.agents.conformance.runner:main", "run the agent conformance suite: MODULE:CLASS"),
}


def usage() -> str:
    w = max(map(len, SUBCOMMANDS))
    lines = ["usage: kvbridge <command> [args]    (kvbridge <command> --help: its options and defaults)", "",
             "commands:"]
    lines += [f"  {name:<{w}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "options:", f"  {'--version':<{w}}  print kvbridge's version and exit"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"kvbridge {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"kvbridge: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    target = SUBCOMMANDS[name][0]
    if name == "serve" and "--check" in rest:  # validate a config and print its deployment
        target, rest = "kvbridge.serving.check:main", [a for a in rest if a != "--check"]
    mod, _, fn = target.partition(":")
    return int(getattr(importlib.import_module(mod), fn)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
