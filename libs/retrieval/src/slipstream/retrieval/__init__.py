"""Retrieval for search agents (Context-1): corpus types and the backend interface.

`types.py` is the contract between the search environment (libs/envs, which plans, prunes and
scores) and whatever answers its tool calls (an in-process index or the search tool service).
"""

from slipstream.retrieval.types import Chunk, Document, SearchBackend, TokenCounter

__all__ = ["Chunk", "Document", "SearchBackend", "TokenCounter"]
