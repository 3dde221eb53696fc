"""Text of a growing token list, cut at the first stop string, handed out in pieces safe to send now.

Owns OpenAI's `stop` semantics at the worker that produces text: generation ends at the first occurrence of
any stop string, the stop text (and anything after it) is never returned, and while streaming, the text that
could still turn out to be the start of a stop string is held back, as is a trailing piece of an unfinished
UTF-8 character. Reports how many tokens the kept text took (usage counts those). Never talks to an executor:
the caller ends the request when `update` says it stopped. With min_tokens (as vLLM), no stop string counts
before that many tokens exist, and afterwards only a match that ends in text produced after them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .text import REPLACEMENT, TextCodec

__all__ = ["TextCutter", "Piece"]


@dataclass(frozen=True)
class Piece:
    """What `update` found: the new text to send, and, once a stop string matched, how many tokens count."""

    text: str
    stopped_at: int | None = None  # tokens up to and including the one that completed the stop string


class TextCutter:
    """Args:
        codec: the model's text codec.
        stops: the request's stop strings (empty: only UTF-8 hold-back, like serving.text.Detokenizer).
        min_tokens: the request's min_tokens.
    """

    def __init__(self, codec: TextCodec, stops: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.codec, self.stops, self.min_tokens = codec, tuple(s for s in stops if s), min_tokens
        self.sent = ""
        self._checked = 0  # tokens whose text is known to hold no stop string
        self._floor = 0    # characters produced before min_tokens was reached (a match must end after)

    def update(self, tokens: list[int], final: bool = False) -> Piece:
        """The text of `tokens` not handed out yet that is safe to send (everything once `final`)."""
        text = self.codec.decode(tokens)
        if len(tokens) < self.min_tokens:
            self._floor = len(text)
        hit = self._find(text) if len(tokens) >= self.min_tokens else None
        if hit is not None:
            n = self._first_stopping_prefix(tokens)
            return Piece(self._delta(text[:hit]), n)
        self._checked = len(tokens)
        limit = len(text)
        if not final:
            limit -= self._held_back(text)
            if text[:limit].endswith(REPLACEMENT):  # a character still being built from byte tokens
                limit = len(text[:limit].rstrip(REPLACEMENT))
        return Piece(self._delta(text[:limit]))

    # --- internals ----------------------------------------------------------------------------------------
    def _find(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self._floor - len(s) + 1)) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _first_stopping_prefix(self, tokens: list[int]) -> int:
        for k in range(max(1, self._checked, self.min_tokens), len(tokens) + 1):
            if self._find(self.codec.decode(tokens[:k])) is not None:
                return k
        return len(tokens)

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper start of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _delta(self, upto: str) -> str:
        if upto.startswith(self.sent):
            out = upto[len(self.sent):]
        else:  # decoding is not always prefix-stable: send what is new
            out = upto[len(os.path.commonprefix([upto, self.sent])):]
        if len(upto) >= len(self.sent) or not upto.startswith(self.sent[:len(upto)]):
            self.sent = upto
        return out
