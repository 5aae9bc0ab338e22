"""ember_core as one package: its top-level modules (llm, device, numerics, output_processor,
structured_outputs), how it imports and is packaged, and what holds end to end (invariance)."""
