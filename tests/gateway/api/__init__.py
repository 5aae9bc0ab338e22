"""The OpenAI endpoints (ember_gateway.api): bodies, validation, conformance, OpenAPI, tools, Responses."""
