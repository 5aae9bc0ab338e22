"""POST /v1/responses (endpoint.py): OpenAI's Responses API, run as the chat completion it asks for."""
