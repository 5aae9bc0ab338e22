"""The HTTP edge: connections defended for an exposed server, the API key, CORS, body intake,
OpenAI's error bodies and server-sent events."""
