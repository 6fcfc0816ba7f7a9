"""slipstream.serve: the OpenAI-compatible front door of a serving rollout worker, and its recorder."""

from slipstream.serve.app import VERSION_HEADER, ServeApp
from slipstream.serve.call_record import CallRecord
from slipstream.serve.chat import ChatFormat
from slipstream.serve.config import ServeConfig
from slipstream.serve.episodes import assemble
from slipstream.serve.feedback import FeedbackPost, Implicit, parse_feedback
from slipstream.serve.pending import Member, MemoryPending, PendingPolicy, PendingStore
from slipstream.serve.pending_redis import RedisPending
from slipstream.serve.protocol import RequestError
from slipstream.serve.record import EpisodeSink, MemorySink, Recorder, StoreSink
from slipstream.serve.release import Releaser
from slipstream.serve.server import ServeEndpoint, pending_policy

__all__ = [
    "VERSION_HEADER",
    "CallRecord",
    "ChatFormat",
    "EpisodeSink",
    "FeedbackPost",
    "Implicit",
    "Member",
    "MemoryPending",
    "MemorySink",
    "PendingPolicy",
    "PendingStore",
    "Recorder",
    "RedisPending",
    "Releaser",
    "RequestError",
    "ServeApp",
    "ServeConfig",
    "ServeEndpoint",
    "StoreSink",
    "assemble",
    "parse_feedback",
    "pending_policy",
]
