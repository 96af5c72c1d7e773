"""The swappable backends: where tokens are generated (`actors.engine`) and where the roles run
(`runtime`). Each is one module holding its config section (the fields users set) and what it
does on this machine: how it is built, what it refuses in one line, how weights reach it, which
servers it starts. The rest of the system asks the chosen backend and never tests its type.

Adding one is a module plus its line below; the config schema, the reference (docs/config.md)
and the launcher pick it up from here.
"""

from pipeline.backends.embedded import EmbeddedEngine
from pipeline.backends.local import LocalRuntime
from pipeline.backends.ray import RayRuntime
from pipeline.backends.sglang import SGLangEngine
from pipeline.backends.simulated import SimulatedEngine
from pipeline.backends.vllm import VLLMEngine
from pipeline.config.base import backend_union

ENGINES = (EmbeddedEngine, SGLangEngine, VLLMEngine, SimulatedEngine)
"""`actors.engine.type` -> its backend; the first is the default."""
RUNTIMES = (LocalRuntime, RayRuntime)
"""`runtime.type` -> its backend; the first is the default."""

EngineConfig = backend_union(ENGINES)
RuntimeConfig = backend_union(RUNTIMES)
