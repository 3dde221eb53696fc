"""The serving layer's name for the text codec, which lives one layer down in `executor/text.py` (the one
codec `kvbridge generate` uses too). Re-exports only; never defines a codec of its own."""

from ..executor.text import REPLACEMENT, Detokenizer, TextCodec

__all__ = ["TextCodec", "Detokenizer", "REPLACEMENT"]
