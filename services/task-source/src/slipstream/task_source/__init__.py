"""Slipstream task source service."""
