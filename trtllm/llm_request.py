"""A minimal `LlmRequest` with TensorRT-LLM's names, and the states a disaggregated request moves through.

Owns the request's state vocabulary (`LlmRequestState`, upstream names) and the few fields the KV cache
manager and the transceiver read: ids, tokens, prompt length, request type, the context phase's params.
Never moves KV and never allocates: KVCacheManager and KvCacheTransceiver do, and they alone move a request
from one disaggregation state to the next.

    context side     CONTEXT_INIT -> (prefill) -> DISAGG_CONTEXT_TRANS_IN_PROGRESS -> DISAGG_CONTEXT_COMPLETE
    generation side  DISAGG_GENERATION_INIT -> DISAGG_GENERATION_TRANS_IN_PROGRESS
                     -> DISAGG_GENERATION_TRANS_COMPLETE -> GENERATION_IN_PROGRESS (the executor's move)
    either side      ... -> DISAGG_TRANS_ERROR (the transfer failed or was cancelled; free the blocks)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..transceiver.params import DisaggParams

__all__ = ["LlmRequest", "LlmRequestState", "LlmRequestType"]


class LlmRequestState(Enum):
    """TensorRT-LLM's request states (the names kvbridge uses; values are kvbridge's own)."""

    UNKNOWN = 0
    ENCODER_INIT = 1
    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 3
    GENERATION_TO_COMPLETE = 4
    GENERATION_COMPLETE = 5
    DISAGG_GENERATION_INIT = 6
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 7
    DISAGG_CONTEXT_COMPLETE = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    DISAGG_GENERATION_TRANS_COMPLETE = 10
    DISAGG_CONTEXT_WAIT_SCHEDULER = 11
    DISAGG_TRANS_ERROR = -1


class LlmRequestType(Enum):
    REQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    REQUEST_TYPE_CONTEXT_ONLY = 1
    REQUEST_TYPE_GENERATION_ONLY = 2


@dataclass(eq=False)
class LlmRequest:
    """The request fields kvbridge's compatibility layer reads (TensorRT-LLM spellings).

    Attributes:
        request_id: the executor's id (also `py_request_id`).
        input_tokens: the prompt.
        max_new_tokens: how many tokens it may generate.
        llm_request_type: context-only, generation-only, or both.
        context_phase_params: the context side's DisaggParams (set by respond_and_send_async; a
            generation-only request carries it in, as a DisaggParams or its dict form).
        state: where the request is (see the module docstring).
        output_tokens: generated tokens (a generation-only request starts with the context's first token).
        error: why the last transfer failed (set with DISAGG_TRANS_ERROR).
    """

    request_id: int
    input_tokens: list[int]
    max_new_tokens: int = 16
    llm_request_type: LlmRequestType = LlmRequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION
    context_phase_params: DisaggParams | dict | None = None
    state: LlmRequestState = LlmRequestState.UNKNOWN
    output_tokens: list[int] = field(default_factory=list)
    error: str = ""

    def __post_init__(self) -> None:
        if type(self.request_id) is not int or self.request_id < 0:
            raise ValueError(f"request_id must be a non-negative int, got {self.request_id!r}")
        if not self.input_tokens:
            raise ValueError(f"request {self.request_id}: input_tokens must not be empty")
        self.input_tokens = [int(t) for t in self.input_tokens]
        if self.state is LlmRequestState.UNKNOWN:
            self.state = (LlmRequestState.DISAGG_GENERATION_INIT if self.is_generation_only_request
                          else LlmRequestState.CONTEXT_INIT)

    @property
    def py_request_id(self) -> int:
        return self.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.input_tokens)

    @property
    def is_context_only_request(self) -> bool:
        return self.llm_request_type is LlmRequestType.REQUEST_TYPE_CONTEXT_ONLY

    @property
    def is_generation_only_request(self) -> bool:
        return self.llm_request_type is LlmRequestType.REQUEST_TYPE_GENERATION_ONLY

    @property
    def is_finished(self) -> bool:
        return self.state is LlmRequestState.GENERATION_COMPLETE

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt then generated tokens (beam 0 only)."""
        if beam != 0:
            raise ValueError("kvbridge requests have one beam")
        return self.input_tokens + self.output_tokens

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self.get_tokens(beam))

    def add_new_token(self, token: int, beam: int = 0) -> None:
        self.get_tokens(beam)
        self.output_tokens.append(int(token))

    def disagg_params(self) -> DisaggParams:
        """The context phase's params as a DisaggParams (validated when they came as a dict)."""
        p = self.context_phase_params
        if p is None:
            raise ValueError(f"request {self.request_id} has no context_phase_params")
        return p if isinstance(p, DisaggParams) else DisaggParams.from_dict(_as_dict(p))


def _as_dict(p: Any) -> dict:
    if not isinstance(p, dict):
        raise ValueError(f"context_phase_params must be a DisaggParams or its dict, got {type(p).__name__}")
    return p
