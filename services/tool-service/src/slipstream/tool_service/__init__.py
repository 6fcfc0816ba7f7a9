"""Slipstream tool-service: tools with a shared backend, answered over NATS request/reply."""
