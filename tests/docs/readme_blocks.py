"""The shell commands README.md and docs/*.md show, as blocks to run (for test_readme_commands.py).

What counts as a command: every fenced block tagged `sh`, `bash` or `shell` (all its lines), and every line
starting with `$ ` in any other fenced block (a command shown with its output). A marker comment on the line
before a block (a line of its own; blank lines between are fine) says how to treat it:

    <!-- readme-test: skip REASON -->        not run; REASON is reported (a GPU, several hosts, an install)
    <!-- readme-test: server URL -->         a server: started in the background, ready when URL answers 200,
                                             stopped with Ctrl-C (SIGINT) once the file's later blocks ran
    <!-- readme-test: skip-file REASON -->   on a line of its own anywhere in a file: none of its blocks run
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SHELL_TAGS = {"sh", "bash", "shell"}
_MARK = re.compile(r"<!--\s*readme-test:\s*([a-z-]+)\s*(.*?)\s*-->")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    script: str
    mode: str = "run"  # run | skip | server
    arg: str = ""  # the skip reason or the server's readiness URL

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def file_skip(text: str) -> str | None:
    """The reason of a file-level skip marker, if the file has one."""
    for line in text.splitlines():
        m = _MARK.fullmatch(line.strip())
        if m and m.group(1) == "skip-file":
            return m.group(2) or "skip-file"
    return None


def blocks(path: str, text: str) -> list[Block]:
    """The command blocks of one Markdown file, in order."""
    out: list[Block] = []
    lines = text.splitlines()
    marker: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MARK.fullmatch(line.strip())
        if m and m.group(1) in ("skip", "server"):
            marker = (m.group(1), m.group(2))
            i += 1
            continue
        f = _FENCE.match(line)
        if not f:
            if line.strip():
                marker = None  # a marker applies to the block right after it only
            i += 1
            continue
        fence, tag, start = f.group(1), f.group(2).lower(), i + 1
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        if tag in SHELL_TAGS:
            script = "\n".join(body)
        else:
            script = "\n".join(ln[2:] for ln in body if ln.startswith("$ "))
        if script.strip():
            mode, arg = marker or ("run", "")
            out.append(Block(path, start, script, mode, arg))
        marker = None
    return out
