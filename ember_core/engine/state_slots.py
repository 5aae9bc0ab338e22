"""The state pool's slots: a hybrid model's recurrent layers keep one fixed-size state per running
sequence (the runner holds the tensors; this only says which sequence holds which slot). A sequence
takes a slot when admitted and gives it back when it finishes or is preempted, as it does its blocks."""

from __future__ import annotations

from ember_core.config import EngineConfig
from ember_core.engine.sequence import Sequence


def refuse_for_hybrid(config: EngineConfig) -> None:
    """What a hybrid model cannot run with yet, refused at start in one line each."""
    if config.speculative_config is not None:
        raise ValueError(
            "speculative decoding is not supported for hybrid models (a rejected draft would have to roll the "
            "recurrent state back): drop --speculative-config"
        )
    if config.tensor_parallel_size != 1:
        raise ValueError("tensor parallelism does not split a hybrid model's recurrent layers yet: use --tensor-parallel-size 1")


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def acquire(self, seq: Sequence) -> bool:
        """Give seq a slot; False when every slot is held (seq waits)."""
        if not self._free:
            return False
        seq.state_slot = self._free.pop()
        return True

    def release(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1
