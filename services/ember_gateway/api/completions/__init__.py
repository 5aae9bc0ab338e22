"""POST /v1/chat/completions (chat.py) and /v1/completions (completions.py), and what they share:
a request's choices, the answer as one body or a stream, logprobs, tools and output constraints."""
