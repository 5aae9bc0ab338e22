"""ember's engine worker process (installed as `ember_engine`)."""
