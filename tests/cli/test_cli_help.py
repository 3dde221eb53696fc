"""Issue 27: the CLI as a newcomer meets it: `--help` on every command and benchmark exits 0 and lists its
options, `kvbridge --help` lists every command, `kvbridge bench --help` every benchmark, `--version` works."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge.bench.__main__ import BENCHES
from kvbridge.cli import SUBCOMMANDS


def kvb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_version_and_the_command_list():
    from kvbridge import __version__

    p = kvb("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"kvbridge {__version__}", p.stdout + p.stderr
    p = kvb("--help")
    assert p.returncode == 0 and all(name in p.stdout for name in SUBCOMMANDS), p.stdout
    p = kvb("bench", "--help")
    assert p.returncode == 0 and all(name in p.stdout for name in BENCHES), p.stdout + p.stderr
    p = kvb("bench")
    assert p.returncode == 2 and "name a benchmark" in p.stderr and "transfer" in p.stderr


@pytest.mark.parametrize("args", [[c] for c in SUBCOMMANDS if c != "bench"] + [["bench", b] for b in BENCHES]
                         + [["serve", "--check"]], ids=lambda a: " ".join(a))
def test_every_command_has_help(args):
    p = kvb(*args, "--help")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "usage:" in p.stdout and "-h, --help" in p.stdout, p.stdout


def test_serve_help_shows_check():
    p = kvb("serve", "--help")
    assert "--check" in p.stdout, p.stdout
