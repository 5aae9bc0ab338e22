"""What operators see: /health, Prometheus metrics, OpenTelemetry traces and the live dashboard."""
