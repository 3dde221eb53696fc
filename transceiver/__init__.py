"""The control plane: versioned msgpack messages over ZeroMQ, the context-side Sender, the generation-side
Receiver, and CacheTransceiver, the per-rank facade with TensorRT-LLM's method names. Each side is an I/O
thread driving explicit state machines (an enum and one `advance` per machine, fsm.py). Never frees KV blocks:
it reports, and the executor frees."""

from .agreement import Agreement
from .cache_transceiver import CacheTransceiver
from .config import TransceiverConfig
from .params import DisaggParams
from .pool import LocalPool
from .pull import ReceiveResult
from .receiver import Receiver
from .sender import Sender, SendResult

__all__ = ["Agreement", "CacheTransceiver", "DisaggParams", "LocalPool", "ReceiveResult", "Receiver",
           "SendResult", "Sender", "TransceiverConfig"]
