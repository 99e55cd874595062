"""Serving: the continuous-batching engine, one job per module.

* `serving.config`: `EngineConfig` (static sizes) and the cache sizes they
  imply;
* `serving.request`: `Request`, `RequestStatus` and request validation;
* `serving.scheduler`: `Scheduler` (queues, rows, chunked prefill,
  admissions, preemption) and the booking of program outputs;
* `serving.kv_manager`: the host side of the KV cache (pool, usage);
* `serving.programs`: the device programs (one step, one decode burst);
* `serving.compiler`: the bounded set of programs, compiled once;
* `serving.engine`: `Engine`, the loop that ties them;
* `serving.stats`: `EngineStats`; `serving.profile`: `Engine.profile`;
* `serving.compile_cache`: the persistent cache of compiled programs.

docs/engine.md describes the design.
"""

from pkvattn.sampling import SamplingParams as SamplingParams
from pkvattn.serving.compiler import ProgramKey as ProgramKey
from pkvattn.serving.config import EngineConfig as EngineConfig
from pkvattn.serving.engine import Engine as Engine
from pkvattn.serving.request import Request as Request
from pkvattn.serving.request import RequestStatus as RequestStatus
from pkvattn.serving.stats import EngineStats as EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "ProgramKey", "Request",
           "RequestStatus", "SamplingParams"]
