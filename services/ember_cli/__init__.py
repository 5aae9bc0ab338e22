"""The `ember` command and `ember-serve`, the launcher of an engine and its gateways (installed as `ember_cli`)."""
