"""What operators see (ember_gateway.observability): the dashboard, traces."""
