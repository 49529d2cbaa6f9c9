"""A follower process of a multi-host engine (process k > 0; `parallel/multihost.py`).

It builds the engine exactly as process 0 does from the same EngineConfig (the same loading,
params placement and KV init, hence the same device calls), then makes the device calls that
process 0's scheduler announces, until process 0 closes its engine. It schedules nothing and
reads no output.
"""

from __future__ import annotations

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model
from jaxinfer.parallel import multihost
from jaxinfer.parallel.sharding import EngineShardings


def follow(config: EngineConfig) -> int:
    """Build `config`'s engine as process 0 does (`LLM`, `jaxinfer run`), then follow process 0's
    device calls until it closes; returns how many calls were made."""
    mesh = EngineShardings.for_config(config.mesh).mesh
    cfg, params, tokenizer = load_model(config.model, config.dtype, config.seed, mesh,
                                        config.quant)  # fmt: skip
    engine = Engine(config, cfg, params, tokenizer)
    return multihost.follow(engine.runner)
