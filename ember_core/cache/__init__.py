from ember_core.cache.block_manager import BlockManager

__all__ = ["BlockManager"]
