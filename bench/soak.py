"""`kvbridge bench soak` (or `python -m kvbridge.bench.soak`): the reliability soak, with JSON output.

Part A: --frames mutated control frames (bit flips, byte edits, truncations, splices of valid frames of every
message type, random bytes, wrong fields/types/versions, lying length headers, deep nesting, ext types,
oversized frames, and the expansion bombs) into `messages.decode`, each timed against --frame-bound-ms; then
a live context rank hammered with --live-frames mutated frames over ZeroMQ while a generation rank pulls
real requests that must all succeed byte-exact (soak_frames.py, soak_live.py).
Part B: --requests requests through a context-only and a generation-only executor with client aborts,
leases left to expire and one generation-executor restart (soak_requests.py).

The JSON holds {frames, crashes, hangs, requests, aborted, restarts, lost, leaked_blocks, corrupted,
kv_checked, kv_mismatched (part B: the positional KV check of every completed request)}, the
durations, and each part's details.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .common import machine, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000,
                    help="frames into the decoder, in all: valid, mutated, oversized, bombs "
                         "(default 1000000)")
    ap.add_argument(
        "--live-frames", type=int, default=300_000,
        help="mutated frames into a live context rank (default 300000)"
    )
    ap.add_argument("--live-requests", type=int, default=0,
                    help="real requests pulled from the live rank at most (default 0: as long as the hammer "
                         "runs, at least 64)")
    ap.add_argument("--requests", type=int, default=10_000,
                    help="part B: requests through the two executors (default 10000)")
    ap.add_argument("--concurrency", type=int, default=24, help="client threads of part B")
    ap.add_argument("--abort-p", type=float, default=0.10, help="fraction of requests aborted by the client")
    ap.add_argument("--expire-p", type=float, default=0.05, help="fraction of context requests never fetched")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument(
        "--no-restart", action="store_true", help="part B without the generation-executor restart"
    )
    ap.add_argument("--frame-bound-ms", type=float, default=100.0, help="a decode slower than this is a hang")
    ap.add_argument(
        "--no-bombs", action="store_true", help="leave out the expansion bombs (seconds each today)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args(argv)

    def say(s: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)

    out: dict = {
        "machine": machine(),
        "command": "kvbridge bench soak " + " ".join(argv or sys.argv[1:]),
        "seed": a.seed,
        "commit": _commit(),
    }
    crashes = hangs = 0
    frames = 0
    if a.frames:
        from .soak_frames import run_decoder

        t0 = time.monotonic()
        st = run_decoder(a.frames, a.seed, a.frame_bound_ms / 1e3, bombs=not a.no_bombs, progress=say)
        rows = st.rows()
        out["decoder"] = {
            "rows": rows,
            "crash_examples": st.crashes[:20],
            "hang_examples": st.hangs[:40],
            "retimed": len(st.retimed),
            "retimed_examples": st.retimed[:20],
            "frame_bound_ms": a.frame_bound_ms,
            "seconds": round(time.monotonic() - t0, 1),
        }
        crashes += len(st.crashes)
        hangs += len(st.hangs)
        frames += sum(r["frames"] for r in rows)
        print(table(rows, ["category", "frames", "decoded", "crashes", "hangs", "max_ms", "mean_us"]))
        for h in st.hangs[:12]:
            print(f"  slow: {h['category']}: {h['seconds']} s ({h['bytes']} bytes)")
    if a.live_frames:
        from .soak_live import run_live

        live = run_live(a.live_frames, a.seed, progress=say, max_requests=a.live_requests)
        out["live"] = live
        frames += a.live_frames
        print(
            f"live context rank: {a.live_frames} mutated frames ({(live['hammer'] or {}).get('answered')} "
            f"answered); {live['requests']} real requests, {live['ok']} ok, {live['failed']} failed, "
            f"{live['mismatched_bytes']} mismatched bytes, {live.get('ctx_pinned_at_end')} pinned at the "
            f"end, {live['seconds']} s"
        )
    if a.requests:
        from .soak_requests import RequestSoak

        with tempfile.TemporaryDirectory(prefix="kvb-soak-") as d:
            req = RequestSoak(
                a.requests,
                a.seed,
                d,
                concurrency=a.concurrency,
                abort_p=a.abort_p,
                expire_p=a.expire_p,
                restart=not a.no_restart,
                max_tokens=a.max_tokens,
                progress=say,
            ).run()
        out["executors"] = req
        print(
            table(
                [req],
                [
                    "requests",
                    "completed",
                    "aborted",
                    "expired",
                    "restarts",
                    "restart_failed",
                    "failed",
                    "lost",
                    "leaked_blocks",
                    "corrupted",
                    "kv_mismatched",
                    "requests_per_s",
                    "run_s",
                ],
            )
        )
        for e, n in list(req["errors"].items())[:8]:
            print(f"  {n} x {e}")
    live = out.get("live") or {}
    req = out.get("executors") or {}
    out.update(
        {
            "frames": frames,
            "crashes": crashes,
            "hangs": hangs,
            "live_requests": live.get("requests", 0),
            "live_failed": live.get("failed", 0),
            "live_mismatched_bytes": live.get("mismatched_bytes", 0),
            "requests": req.get("requests", 0),
            "aborted": req.get("aborted", 0),
            "restarts": req.get("restarts", 0),
            "lost": req.get("lost", 0),
            "leaked_blocks": req.get("leaked_blocks", 0),
            "corrupted": req.get("corrupted", 0),
            "kv_checked": req.get("kv_checked", 0),
            "kv_mismatched": req.get("kv_mismatched", 0),
            "durations_s": {
                "decoder": (out.get("decoder") or {}).get("seconds"),
                "live": live.get("seconds"),
                "executors": req.get("run_s"),
            },
        }
    )
    keys = [
        "frames",
        "crashes",
        "hangs",
        "live_requests",
        "live_failed",
        "requests",
        "aborted",
        "restarts",
        "lost",
        "leaked_blocks",
        "corrupted",
        "kv_mismatched",
    ]
    print(table([out], keys))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {a.json}")
    bad = (
        crashes
        or hangs
        or out["live_failed"]
        or out["live_mismatched_bytes"]
        or out["lost"]
        or out["leaked_blocks"]
        or out["corrupted"]
        or out["kv_mismatched"]
    )
    return 1 if bad else 0


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            check=False,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    sys.exit(main())
