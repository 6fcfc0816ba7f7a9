"""Slipstream weight-publisher service."""
