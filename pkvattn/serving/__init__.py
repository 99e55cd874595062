"""Serving: the continuous-batching engine, split along its three concerns.

* `serving.config`: `EngineConfig` (static sizes) and `Request` (host record);
* `serving.programs`: the device programs (one step, one decode burst), their
  inputs / outputs and the bounded set of compiled variants;
* `serving.engine`: `Engine`, the host scheduler calling those programs;
* `serving.stats`: `EngineStats`; `serving.profile`: `Engine.profile`;
* `serving.compile_cache`: JAX's persistent compilation cache.
"""

from pkvattn.sampling import SamplingParams as SamplingParams
from pkvattn.serving.config import EngineConfig as EngineConfig
from pkvattn.serving.config import Request as Request
from pkvattn.serving.engine import Engine as Engine
from pkvattn.serving.programs import ProgramKey as ProgramKey
from pkvattn.serving.stats import EngineStats as EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "ProgramKey", "Request",
           "SamplingParams"]
