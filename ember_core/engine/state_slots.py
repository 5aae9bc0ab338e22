"""The state pool's slots: a hybrid model's recurrent layers keep one fixed-size state per running
sequence (the runner holds the tensors; this only says which sequence holds which slot). A sequence
takes a slot when admitted and gives it back when it finishes or is preempted, as it does its blocks."""

from __future__ import annotations

from ember_core.config import EngineConfig
from ember_core.engine.sequence import Sequence


def state_pool_slots(config: EngineConfig, bytes_per_slot: int) -> tuple[int, int]:
    """(running sequences' slots, prefix checkpoints' slots): one per --max-num-seqs and, with prefix
    caching, as many checkpoints, within half of --kv-cache-mib (the KV blocks keep the rest); fewer,
    as many of each, where half does not hold them."""
    per_sequence = 2 if config.enable_prefix_caching else 1
    running = config.max_num_seqs
    if config.num_blocks is None:
        fits = int(config.kv_cache_mib * 2**20) // 2 // (bytes_per_slot * per_sequence)
        if fits == 0:
            raise ValueError(
                f"half of a {config.kv_cache_mib:g} MiB KV cache cannot hold the model's state pool "
                f"({bytes_per_slot * per_sequence / 2**20:.1f} MiB per running sequence): raise --kv-cache-mib"
            )
        running = min(running, fits)
    return running, running if config.enable_prefix_caching else 0


def refuse_for_hybrid(config: EngineConfig) -> None:
    """What a hybrid model cannot run with yet, refused at start in one line each."""
    if config.speculative_config is not None:
        raise ValueError(
            "speculative decoding is not supported for hybrid models (a rejected draft would have to roll the "
            "recurrent state back): drop --speculative-config"
        )


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
