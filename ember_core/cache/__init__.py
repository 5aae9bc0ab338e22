from ember_core.cache.block_manager import DROPPED_BLOCK, BlockManager

__all__ = ["DROPPED_BLOCK", "BlockManager"]
