"""The model an engine serves, as the gateway sees it: its card and the tokenizer built from the
card's spec (once per distinct spec, off the event loop)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import msgspec

from ember_core.tokenizer import Tokenizer, TokenizerSpec
from ember_proto import ModelCard

logger = logging.getLogger(__name__)

# The card's settings that, besides the weights, fix an engine's tokens and logprobs (docs/design.md).
BITS_SETTINGS = ("dtype", "numerics", "kv_cache_dtype", "cpu_build")


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in `model`
    engine_id: str
    card: ModelCard
    tokenizer: Tokenizer | None  # None: the model has no tokenizer; only token-id prompts work
    block_size: int = 0  # of the engine's prefix cache; 0: none
    step_token_budget: int = 0  # tokens one engine step computes at most; 0: the engine did not say
    task: str = "generate"  # "embed": the engine answers embedding requests only
    adapter: str = ""  # a LoRA adapter over the engine's model (then name is the adapter's): its requests run with it
    parent: str | None = None  # an adapter's base model, as clients name it

    def with_adapter(self, adapter: str) -> ServedModel:
        """The adapter served over this model, named as clients name it."""
        return replace(self, name=adapter, adapter=adapter, parent=self.name)

    def settings_apart(self, other: ServedModel) -> list[str]:
        """The BITS_SETTINGS in which the two engines differ, as "dtype float32 vs bfloat16"."""
        mine, theirs = (msgspec.structs.asdict(card) for card in (self.card, other.card))
        return [f"{name} {mine[name] or '?'} vs {theirs[name] or '?'}" for name in BITS_SETTINGS if mine[name] != theirs[name]]

    def same_model(self, other: ServedModel) -> bool:
        """Whether a request of one can continue on the other: the same weights and tokens, computed
        with the same settings (else the rest of its text would come from other arithmetic)."""
        same_weights = (self.card.model_id, self.card.vocab_size, self.card.tokenizer_spec) == (
            other.card.model_id, other.card.vocab_size, other.card.tokenizer_spec
        )
        return same_weights and not self.settings_apart(other)


class TokenizerCache:
    """The tokenizer of the latest spec an engine announced; an engine that restarts with the same
    model reuses it."""

    def __init__(self) -> None:
        self._source: bytes | None = None
        self._tokenizer: Tokenizer | None = None

    async def get(self, spec_bytes: bytes) -> Tokenizer | None:
        """None when the spec is empty or the tokenizer cannot be built: token-id prompts only."""
        if not spec_bytes:
            return None
        if spec_bytes != self._source:
            try:
                tokenizer = await asyncio.to_thread(_build_tokenizer, spec_bytes)
            except Exception:
                logger.exception("could not build the engine's tokenizer; serving token-id prompts only")
                tokenizer = None
            self._source, self._tokenizer = spec_bytes, tokenizer
        return self._tokenizer


def _build_tokenizer(spec_bytes: bytes) -> Tokenizer:
    return Tokenizer.from_spec(msgspec.msgpack.decode(spec_bytes, type=TokenizerSpec))
