"""The link to the engines (ember_gateway.engines): routing, migration, the pool."""
