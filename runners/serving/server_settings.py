"""What `llmrun serve` is asked to do, as one typed record (`server.start` takes it). Plain data:
the command line builds it without importing the server's libraries."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig


@dataclass(frozen=True)
class ServerSettings:
    """The model and its engine, where the server listens, how many requests it holds and
    serves at once, who may reach it, and the sampling defaults requests override."""

    model: str | None = None  # a path or a Hub reference; None: the embedded model
    engine: EngineConfig = field(default_factory=EngineConfig)
    defaults: SamplingParams = field(default_factory=SamplingParams)
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port
    n_seq: int = 4  # sequences decoded together (-np)
    policy: str | None = None  # --policy; None: chunked:<batch>
    max_queue: int = 64
    max_connections: int = 512
    origins: frozenset[str] = frozenset()  # --allow-origin, parsed (api_access.parse_origins)
    drain_s: float = 30.0  # how long SIGTERM waits for the requests in flight
    alias: str | None = None  # the model's name in /v1/models; None: the file's name
    energy: str = "auto"  # --energy: on, auto or off (/metrics' joules by phase)
