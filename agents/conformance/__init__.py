"""The TransferAgent conformance suite, shipped with kvbridge so that agent authors can run it.

    kvbridge check-agent my_package.my_module:MyAgent [--memory dram|vram] [--timeout S] [--only a,b]

runs every check of `checks.py` against the class in real processes (this process holds the local agent, a
spawned process the peer) and prints a pass/fail table; exit code 0 only if all pass. kvbridge's own tests
run the very same checks (tests/agents/test_conformance.py) over its built-in agents.

Owns the checks, the peer process and the runner. Never imports a transport itself: the agent under test
does.
"""

from .checks import CHECKS, Check, CheckFailed, Pair
from .runner import CheckResult, Memory, Outcome, main, run_suite

__all__ = ["CHECKS", "Check", "CheckFailed", "Pair", "CheckResult", "Memory", "Outcome", "main", "run_suite"]
