"""The persistent store's folder: where each rank's blocks live, which keys are usable, and LRU eviction.

    <root>/<namespace>/r<rank>/<key[:2]>/<key>.kvb      one object file per (block key, rank): the rank's shard

Object files are written and verified by the file agent (agents/file_agent.py: atomic replace, fixed header,
checksum); this module only reads headers, touches files and deletes them. A key is usable when EVERY rank's
file has a valid, complete header naming that key and rank; anything else is a miss (logged when a file is
there but unusable), never loaded.

Recency is the files' modification time: a hit touches the key's files on every rank (utime), a write sets it.
Eviction keeps the whole root (every namespace) under `max_bytes`: it scans the folder, groups files by
(namespace, key), deletes the least recently used groups whole until usage is at `low_water * max_bytes`, and
deletes temporary files older than TMP_GRACE_S (left by a crashed writer). Several processes and instances
may share a root: one evicts at a time (a non-blocking flock on <root>/.evict.lock; the others skip), and
every step tolerates files vanishing under it. Never deletes a file it did not find in its scan.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass

from ...agents.file_agent import ObjectHeader, object_path, read_header

log = logging.getLogger(__name__)

__all__ = ["TMP_GRACE_S", "EvictStats", "KvStore"]

TMP_GRACE_S = 600.0


@dataclass(frozen=True)
class EvictStats:
    bytes_before: int
    bytes_after: int
    files_deleted: int
    groups_deleted: int


class KvStore:
    """One namespace's view of a store root.

    Args:
        root: the store folder (shared by any number of executors and namespaces).
        namespace: 32 hex digits (see keys.namespace_for).
        world_size: ranks whose files make up one key.
        max_bytes: bound on the whole root (0: unbounded).
        low_water: eviction brings usage down to this fraction of max_bytes.
    """

    def __init__(self, root: str, namespace: str, world_size: int, *, max_bytes: int = 0,
                 low_water: float = 0.8) -> None:
        self.root, self.namespace, self.world = os.path.abspath(root), namespace, int(world_size)
        self.max_bytes, self.low_water = int(max_bytes), float(low_water)
        self._estimate: int | None = None      # bytes in the root at the last scan + bytes written since
        self._mu = threading.Lock()
        self._evicting: threading.Thread | None = None
        self.last_evict: EvictStats | None = None

    # --- names ----------------------------------------------------------------------------------------
    def rank_dir(self, rank: int) -> str:
        return os.path.join(self.root, self.namespace, f"r{rank}")

    def tag(self, rank: int) -> bytes:
        """What the file agent writes into (and checks in) every header of `rank`'s files."""
        return bytes.fromhex(self.namespace) + f"r{rank}".encode()

    def path(self, key: str, rank: int) -> str:
        return object_path(self.rank_dir(rank), key)

    # --- lookups (scheduler side) ---------------------------------------------------------------------
    def usable(self, key: str, rank: int) -> bool:
        """Rank `rank`'s file of `key` has a valid, complete header for this key and rank (payload unchecked)."""
        path = self.path(key, rank)
        hdr = read_header(path)
        if isinstance(hdr, ObjectHeader) and hdr.complete and hdr.name == key \
                and hdr.tag == self.tag(rank).ljust(32, b"\0"):
            return True
        if hdr != "no such object":
            why = hdr if isinstance(hdr, str) else "truncated or foreign (size, name or tag do not match)"
            log.warning("KV store: %s is unusable (%s); treated as a miss", path, why)
        return False

    def probe(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are usable on every rank; touches their files (recency)."""
        n = 0
        for key in keys:
            if not all(self.usable(key, r) for r in range(self.world)):
                break
            n += 1
        now = time.time()
        for key in keys[:n]:
            for r in range(self.world):
                try:
                    os.utime(self.path(key, r), (now, now))
                except OSError:
                    pass  # evicted since: the load will fail and the request recompute
        return n

    def missing(self, keys: list[str]) -> list[int]:
        """Indices of `keys` not usable on every rank (what a save should write)."""
        return [i for i, k in enumerate(keys) if not all(self.usable(k, r) for r in range(self.world))]

    # --- size bound -----------------------------------------------------------------------------------
    def note_written(self, nbytes: int) -> None:
        """`nbytes` were added to the root (by this process's estimate); evict in the background when over."""
        if self.max_bytes <= 0:
            return
        with self._mu:
            if self._estimate is not None:
                self._estimate += int(nbytes)
            over = self._estimate is None or self._estimate > self.max_bytes
            if not over or (self._evicting is not None and self._evicting.is_alive()):
                return
            self._evicting = threading.Thread(target=self.evict, daemon=True, name="kvbridge-evict")
            self._evicting.start()

    def close(self, timeout: float = 30.0) -> None:
        """Let a running eviction finish (bounded), then evict once more if this process thinks it is over."""
        t = self._evicting
        if t is not None:
            t.join(timeout)
        if self.max_bytes > 0 and (self._estimate is None or self._estimate > self.max_bytes):
            self.evict()

    def evict(self) -> EvictStats | None:
        """Scan the root and delete least recently used keys down to the low water mark (if over the bound).

        Returns:
            What it did, or None when another process holds the eviction lock (it is evicting now).
        """
        os.makedirs(self.root, exist_ok=True)
        import fcntl

        fd = os.open(os.path.join(self.root, ".evict.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    with self._mu:  # the other evictor brings it down; count from its target
                        self._estimate = int(self.low_water * self.max_bytes)
                    return None
                raise
            stats = self._evict_locked()
        finally:
            os.close(fd)
        with self._mu:
            self._estimate = stats.bytes_after
        self.last_evict = stats
        if stats.groups_deleted:
            log.info("KV store %s: evicted %d keys (%d files), %d -> %d bytes", self.root, stats.groups_deleted,
                     stats.files_deleted, stats.bytes_before, stats.bytes_after)
        return stats

    def _evict_locked(self) -> EvictStats:
        groups: dict[tuple[str, str], list] = {}   # (namespace, key) -> [bytes, newest mtime, [paths]]
        total, deleted = 0, 0
        now = time.time()
        for path, name, st in _scan(self.root):
            if name.endswith(".kvb"):
                g = groups.setdefault((path.split(os.sep)[-4], name[:-4]), [0, 0.0, []])
                g[0] += st.st_size
                g[1] = max(g[1], st.st_mtime)
                g[2].append(path)
                total += st.st_size
            elif ".kvb.tmp." in name:
                if now - st.st_mtime > TMP_GRACE_S and _unlink(path):
                    deleted += 1
                else:
                    total += st.st_size
        before = total
        ngroups = 0
        if self.max_bytes > 0 and total > self.max_bytes:
            target = int(self.low_water * self.max_bytes)
            for size, _, paths in sorted(groups.values(), key=lambda g: g[1]):
                if total <= target:
                    break
                for p in paths:
                    deleted += _unlink(p)
                total -= size
                ngroups += 1
        return EvictStats(before, total, deleted, ngroups)

    def usage(self) -> int:
        """Bytes of every file under the root now (a scan)."""
        return sum(st.st_size for _, _, st in _scan(self.root))


def _scan(root: str):
    """(path, name, stat) of every file under root/<ns>/<rank>/<fan>/, tolerating entries that vanish."""
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < 3:
                        stack.append((e.path, depth + 1))
                elif depth == 3 and e.is_file(follow_symlinks=False):
                    yield e.path, e.name, e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
