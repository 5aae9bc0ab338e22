"""ember_gateway: the stateless OpenAI-compatible HTTP front of an ember engine (see cli.py)."""
