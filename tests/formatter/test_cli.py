"""`kvbridge verify-layout`: exit 0 with fragment counts, 1 on a mismatch, 2 with the reason if invalid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbridge import cli
from kvbridge.formatter import verify
from kvbridge.formatter.planner import Fragments

BASE = ["verify-layout", "--layers", "30", "--head-dim", "8", "--ctx-block", "16", "--gen-block", "48"]


def test_valid_split_prints_ok_with_fragment_counts_per_generation_rank(capsys):
    rc = cli.main(BASE + ["--ctx", "tp=6,pp=1", "--gen", "tp=3,pp=3", "--kv-heads", "3", "--ctx-layers", "30",
                          "--gen-layers", "12,9,9", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.strip().endswith("OK")
    direct = next(line for line in out.splitlines() if line.strip().startswith("direct:"))
    assert "OK" in direct and all(f"gen{g}:" in direct for g in range(9))
    assert "staged: OK" in out and "TP3 x PP3 (layers 12/9/9)" in out


def test_mla_and_uneven_explicit_layers_from_the_installed_command():
    exe = os.path.join(os.path.dirname(sys.executable), "kvbridge")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "kvbridge.cli"]
    args = ["--ctx", "tp=1,pp=4", "--ctx-layers", "8,8,7,7", "--gen", "tp=4", "--mla", "--tokens", "100",
            "--mapping"]
    p = subprocess.run(cmd + BASE + args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MLA latent" in p.stdout and "gen rank 3:" in p.stdout and p.stdout.strip().endswith("OK")


@pytest.mark.parametrize("args,why", [
    (["--ctx", "tp=6,pp=1", "--gen", "tp=4,pp=3", "--kv-heads", "3"],
     "generation layout: tp=4 cannot shard 3 kv heads"),
    (["--ctx", "tp=2,pp=1", "--gen", "tp=2", "--kv-heads", "4", "--ctx-layers", "8,8,7"],
     "context layout: layers_per_stage has 3 entries but pp=1"),
    (["--ctx", "tp=2,pp=3", "--gen", "tp=2", "--kv-heads", "4", "--ctx-layers", "10,10,9"],
     "sums to 29, the model has 30 layers"),
    (["--ctx", "tp=two", "--gen", "tp=2", "--kv-heads", "4"], "expected tp=N,pp=M"),
    (["--ctx", "tp=1", "--gen", "tp=1"], "--kv-heads is required"),
    (["--ctx", "tp=1", "--gen", "tp=1", "--kv-heads", "2", "--mla"], "one latent 'head'"),
    (["--ctx", "tp=1", "--gen", "tp=1", "--kv-heads", "8", "--tokens", "1000000"], "pass fewer --tokens"),
])
def test_invalid_split_exits_2_with_the_reason(capsys, args, why):
    rc = cli.main(BASE + args)
    err = capsys.readouterr().err
    assert rc == 2 and why in err, err


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["verify-layout", "--ctx", "tp=1"]) == 2
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_lost_fragment_is_caught_and_exits_1(monkeypatch, capsys, path):
    """Fault injection: the planner's output loses its last fragment; every byte is compared, so it shows."""
    if path == "direct":
        real = verify.plan_pieces

        def lossy(*a, **kw):
            out = real(*a, **kw)
            r = max(out)
            f = out[r]
            out[r] = Fragments(f.src[:-1], f.dst[:-1], f.length[:-1])
            return out
        monkeypatch.setattr(verify, "plan_pieces", lossy)
    else:
        real = verify.plan_unpack

        def lossy(*a, **kw):
            f = real(*a, **kw)
            return Fragments(f.src[:-1], f.dst[:-1], f.length[:-1])
        monkeypatch.setattr(verify, "plan_unpack", lossy)
    rc = cli.main(BASE + ["--ctx", "tp=2", "--gen", "tp=4", "--kv-heads", "8", "--path", path])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "MISMATCH gen" in out and out.strip().endswith("MISMATCH")
