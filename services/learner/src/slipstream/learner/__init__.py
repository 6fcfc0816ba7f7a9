"""Slipstream learner service."""
