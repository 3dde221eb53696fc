"""The control plane: versioned msgpack messages over ZeroMQ, the context-side Sender, the generation-side
Receiver, and CacheTransceiver, the per-rank facade with TensorRT-LLM's method names."""

from .cache_transceiver import CacheTransceiver
from .config import TransceiverConfig
from .params import DisaggParams
from .pool import LocalPool
from .pull import ReceiveResult
from .receiver import Receiver
from .sender import Sender, SendResult

__all__ = ["CacheTransceiver", "DisaggParams", "LocalPool", "ReceiveResult", "Receiver",
           "SendResult", "Sender", "TransceiverConfig"]
