"""The control plane: versioned msgpack messages over ZeroMQ, the context-side Sender, the generation-side
Receiver, and CacheTransceiver, the per-rank facade with TensorRT-LLM's method names."""

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
