"""Structured outputs' token masks for a step, filled by llguidance on a worker thread while the
forward pass runs (it releases the GIL); the sampler reads each row when it masks the logits."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np


@dataclass(frozen=True)
class TokenMask:
    """One sequence's row of a step's next-token bitmasks (bit i of 32-bit word w allows token
    32 w + i), which may still be being filled."""

    batch: Future[np.ndarray]
    row: int

    def allowed_words(self) -> np.ndarray:
        return self.batch.result()[self.row]


class TokenMaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads=1)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-token-masks")

    def next_token_masks(self, matchers: list[llguidance.LLMatcher]) -> list[TokenMask]:
        """The matchers' masks of the tokens allowed next, filled in the background: the caller runs
        the forward pass meanwhile and must not feed the matchers until it has read the masks."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self._vocab_size)

        def fill() -> np.ndarray:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(len(matchers)))), bitmask)
            return bitmask

        batch = self._thread.submit(fill)
        return [TokenMask(batch, row) for row in range(len(matchers))]
