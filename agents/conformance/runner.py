"""`kvbridge check-agent MODULE:CLASS [--memory dram|vram]`: the conformance suite as a command.

Owns running the checks of `checks.py` one by one against a user's agent class (local agent in this process,
its peers in spawned processes), each under a watchdog, and printing a pass/fail table. Exit code 0 only if
every check passed; 1 if any failed; 2 for bad arguments or a machine that cannot run the asked memory kind.
Never retries a failed check and never hides one: a check that hangs is reported as failed by name, and the
remaining ones are not run (the agent is in an unknown state), which also counts as failure.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .checks import CHECKS, Check, CheckFailed, Pair

__all__ = ["Memory", "Outcome", "CheckResult", "run_suite", "main"]


class Memory(enum.Enum):
    DRAM = "dram"
    VRAM = "vram"


class Outcome(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    NOT_RUN = "NOT RUN"


@dataclass(frozen=True)
class CheckResult:
    name: str
    outcome: Outcome
    seconds: float
    detail: str = ""


def devices(memory: Memory) -> tuple[str, str]:
    """(local device, peer device); ValueError saying why if this machine cannot provide them."""
    if memory is Memory.DRAM:
        return "cpu", "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--memory vram needs a CUDA GPU; torch.cuda.is_available() is False here")
    return "cuda:0", ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")


def _run_one(check: Check, pair: Pair, watchdog: float) -> tuple[CheckResult, bool]:
    """Run one check in a thread bounded by `watchdog` seconds; (result, whether it hung)."""
    box: list[BaseException | None] = []

    def body() -> None:
        try:
            pair.reset()
            check.run(pair)
            box.append(None)
        except BaseException as e:  # noqa: BLE001 - every failure becomes a row of the table
            box.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=body, daemon=True, name=f"check-{check.name}")
    t.start()
    t.join(watchdog)
    took = time.monotonic() - t0
    if t.is_alive():
        return CheckResult(check.name, Outcome.FAIL, took, f"hung: did not return within {watchdog:g} s"), True
    err = box[0]
    if err is None:
        return CheckResult(check.name, Outcome.PASS, took), False
    detail = str(err) if isinstance(err, CheckFailed) else f"{type(err).__name__}: {err}"
    return CheckResult(check.name, Outcome.FAIL, took, detail), False


def run_suite(spec: str, memory: Memory = Memory.DRAM, *, timeout: float = 30.0,
              only: Sequence[str] | None = None, start_timeout: float | None = None,
              report: Callable[[CheckResult], None] = lambda r: None) -> tuple[list[CheckResult], bool]:
    """Run the checks (all, or those named in `only`) against `spec`; (results in order, whether one hung).

    Args:
        spec: "module:Class" or a registry name.
        memory: where both buffers live.
        timeout: seconds any one transfer may take (the deadline every wait in the checks uses).
        only: check names to run; ValueError naming unknown ones.
        start_timeout: seconds the peer process may take to start and send its metadata (default: twice
            `timeout`, at least 30).
        report: called with each result as soon as it is known.
    """
    names = {c.name for c in CHECKS}
    unknown = sorted(set(only or ()) - names)
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CHECKS)}")
    todo = [c for c in CHECKS if not only or c.name in only]
    local_dev, peer_dev = devices(memory)
    t0 = time.monotonic()
    try:
        pair = Pair.open(spec, local_dev, peer_dev, timeout=timeout, start_timeout=start_timeout)
    except Exception as e:  # noqa: BLE001 - a class that cannot even be set up fails every check
        # Said once (a peer's traceback or stack can be long); the checks are not run.
        took = time.monotonic() - t0
        results = [CheckResult("setup", Outcome.FAIL, took, f"{type(e).__name__}: {e}")]
        results += [CheckResult(c.name, Outcome.NOT_RUN, 0.0, "not run: setup failed") for c in todo]
        for r in results:
            report(r)
        return results, False
    results, hung = [], False
    for check in todo:
        if hung:
            r = CheckResult(check.name, Outcome.NOT_RUN, 0.0, "not run: an earlier check hung")
        else:
            r, hung = _run_one(check, pair, 3 * timeout + 60)
        results.append(r)
        report(r)
    if not hung:
        closer = threading.Thread(target=pair.close, daemon=True, name="check-close")
        closer.start()
        closer.join(timeout + 30)
        hung = closer.is_alive()
    return results, hung


def _row(r: CheckResult, width: int) -> str:
    return f"  {r.name:<{width}}  {r.outcome.value:<7}  {r.seconds:7.2f} s  {r.detail}".rstrip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge check-agent",
                                 description="Run the TransferAgent conformance suite against an agent class, "
                                             "in real processes, and print a pass/fail table.")
    ap.add_argument("agent", nargs="?", help="MODULE:CLASS (e.g. examples.custom_agent:CmaAgent) or a registered name")
    ap.add_argument("--memory", choices=[m.value for m in Memory], default="dram",
                    help="where the buffers live (vram: cuda:0 locally, cuda:1 for the peer if there is one)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds any one transfer may take (default 30)")
    ap.add_argument("--start-timeout", type=float, default=None,
                    help="seconds the peer process may take to start (default: twice --timeout, at least 30)")
    ap.add_argument("--only", default="", help="comma-separated check names to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    args = ap.parse_args(argv)
    width = max(len(c.name) for c in CHECKS)
    if args.list:
        for c in CHECKS:
            print(f"  {c.name:<{width}}  {c.doc}")
        return 0
    if not args.agent:
        ap.error("name the agent class to check: MODULE:CLASS")
    only = [s for s in args.only.split(",") if s]
    print(f"kvbridge check-agent {args.agent} (memory {args.memory}, timeout {args.timeout:g} s)")
    print(f"  {'check':<{width}}  {'result':<7}  {'time':>9}  detail")
    try:
        results, hung = run_suite(args.agent, Memory(args.memory), timeout=args.timeout, only=only,
                                  start_timeout=args.start_timeout,
                                  report=lambda r: print(_row(r, width), flush=True))
    except ValueError as e:
        print(f"kvbridge check-agent: {e}", file=sys.stderr)
        return 2
    passed = sum(r.outcome is Outcome.PASS for r in results)
    failed = [r.name for r in results if r.outcome is Outcome.FAIL]
    not_run = sum(r.outcome is Outcome.NOT_RUN for r in results)
    print(f"{passed} of {len(results)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; {not_run} not run" if not_run else ""))
    code = 0 if passed == len(results) else 1
    if hung:  # a thread of the agent is stuck: do not wait for it at interpreter exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
