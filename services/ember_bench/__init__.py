"""ember_bench: `ember bench serve` (an OpenAI-compatible endpoint under load) and
`ember bench offline` (the in-process engine across batching, admission and dtype settings)."""
