"""Tests of ember_core/lora: LoRA adapters over a base model."""
