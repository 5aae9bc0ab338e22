"""The HTTP edge (ember_gateway.edge): connections, Expect: 100-continue, SSE."""
