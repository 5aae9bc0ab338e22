"""Tensor parallelism: one model's layers split over several processes (torch.distributed)."""
