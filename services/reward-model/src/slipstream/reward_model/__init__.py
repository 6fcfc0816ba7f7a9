"""Slipstream reward-model service."""
