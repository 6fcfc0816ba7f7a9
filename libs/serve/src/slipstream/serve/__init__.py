"""slipstream.serve: the OpenAI-compatible front door of a serving rollout worker, and its recorder."""

from slipstream.serve.app import VERSION_HEADER, ServeApp
from slipstream.serve.chat import ChatFormat
from slipstream.serve.config import ServeConfig
from slipstream.serve.episodes import assemble
from slipstream.serve.protocol import RequestError
from slipstream.serve.record import CallRecord, EpisodeSink, MemorySink, Recorder, StoreSink
from slipstream.serve.server import ServeEndpoint

__all__ = [
    "VERSION_HEADER",
    "CallRecord",
    "ChatFormat",
    "EpisodeSink",
    "MemorySink",
    "Recorder",
    "RequestError",
    "ServeApp",
    "ServeConfig",
    "ServeEndpoint",
    "StoreSink",
    "assemble",
]
