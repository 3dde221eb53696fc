"""The error hierarchy shared by every kvbridge package.

Every error a user or a peer can cause is a `KvBridgeError` with a message that says what was wrong and,
where it helps, what to do. Errors caused by input from the network are `ProtocolError`s (or a subclass)
and never `AssertionError`s.
"""

from __future__ import annotations


class KvBridgeError(Exception):
    """Base of every kvbridge error."""


# --- agents -------------------------------------------------------------------------------------------
class AgentError(KvBridgeError):
    """A transfer agent could not do what was asked (bad descriptors, unknown peer, backend failure)."""


class RegistrationError(AgentError):
    """Memory could not be registered, or a descriptor lies outside every registered region."""


class PeerError(AgentError):
    """A peer is unknown, its metadata is malformed or of another agent kind, or it is unreachable."""


class TransferFailed(AgentError):
    """A transfer ended in failure (the backend reported an error, or it was cancelled)."""


class TransferTimeout(AgentError, TimeoutError):
    """A wait on a transfer reached its deadline before the transfer finished."""


class ConnectionFailed(AgentError):
    """A two-sided connection (agents/connection.py) broke: I/O error, aborted, or a peer's bad frame."""


class ConnectionClosed(ConnectionFailed):
    """The peer closed the connection (or the process behind it died) before all bytes moved."""


class ConnectionDeadline(ConnectionFailed, TimeoutError):
    """A send, recv or connection set-up did not finish before its deadline; the connection is unusable."""


# --- formatter ----------------------------------------------------------------------------------------
class LayoutError(KvBridgeError):
    """A KV layout or parallel split is invalid on its own (e.g. TP that does not shard the kv heads)."""


class LayoutMismatchError(LayoutError):
    """Context and generation layouts cannot exchange KV (different head_dim, dtype, layer count, ...)."""


class PlanError(KvBridgeError):
    """Block ids or token counts cannot be planned (too few block ids, an id outside the pool, ...)."""


# --- transceiver --------------------------------------------------------------------------------------
class ProtocolError(KvBridgeError):
    """A wire message was malformed, oversized, of an unknown type or version, or named a bad field."""


class TransceiverError(KvBridgeError):
    """A KV transfer request failed in the control plane (unknown request, expired lease, peer gone)."""


class RequestNotFound(TransceiverError):
    """The peer does not know the request id (never registered, already released, or lease expired)."""


class LeaseExpired(TransceiverError):
    """The context side released the request's blocks because its lease ran out."""


class DeadlineExceeded(TransceiverError, TimeoutError):
    """A request did not complete before its deadline."""


class RequestCancelled(TransceiverError):
    """The request was cancelled (by the client, the router, or either executor)."""


class IntegrityError(TransceiverError):
    """Verification found received KV bytes that differ from the context side's (checksum mismatch)."""


class PeerGone(TransceiverError):
    """The peer stopped answering (no heartbeat within the deadline) or closed the connection."""


class ReadAheadRefused(TransceiverError):
    """A context rank refused a read-ahead (reads posted from the block ids in DisaggParams before its Blocks
    answer): the request was not published complete under a secret the context rank made, or the block ids
    differ from the published ones."""


# --- executor -----------------------------------------------------------------------------------------
class KVCacheError(KvBridgeError):
    """A KV cache manager call named an unknown request, freed one twice, or unpinned one not pinned."""


class KVCacheExhausted(KVCacheError):
    """The pool has too few free blocks for a request; the request was refused and nothing changed."""


class ExecutorError(KvBridgeError):
    """The reference executor failed: a rank died, a step timed out, a model could not be loaded."""


# --- serving ------------------------------------------------------------------------------------------
class ServingError(KvBridgeError):
    """A worker, the router or the launcher failed (a worker died, none is healthy, a hop ran out of time)."""


class ServeConfigError(ServingError):
    """The serving config (YAML) is invalid; the message names the bad key and what is accepted."""
