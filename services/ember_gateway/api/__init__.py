"""The OpenAI HTTP API's endpoints: chat and legacy completions (completions/), the Responses API
(responses/), embeddings, tokenize, models, and the request and response bodies they share."""
