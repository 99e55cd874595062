"""`pkvattn.engine`: the public names of the serving engine (`pkvattn.serving`)."""

from pkvattn.sampling import SamplingParams as SamplingParams
from pkvattn.serving.compiler import ProgramKey as ProgramKey
from pkvattn.serving.config import EngineConfig as EngineConfig
from pkvattn.serving.engine import Engine as Engine
from pkvattn.serving.programs import CACHE_OPS_SCOPE as CACHE_OPS_SCOPE
from pkvattn.serving.request import Request as Request
from pkvattn.serving.request import RequestStatus as RequestStatus
from pkvattn.serving.stats import EngineStats as EngineStats

__all__ = ["CACHE_OPS_SCOPE", "Engine", "EngineConfig", "EngineStats",
           "ProgramKey", "Request", "RequestStatus", "SamplingParams"]
