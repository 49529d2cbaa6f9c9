"""`jaxinfer serve`: its config (`ServeConfig`), loading and warming the model, and uvicorn.

A config is YAML with an `engine:` section (EngineConfig, as in a run config: a run config's
other sections are ignored) and an optional `serve:` section (ServeOptions); dotted overrides
(`engine.max_num_seqs=64 serve.port=8001`) apply over it. `Server` runs the whole thing in
background threads of this process (the tests, notebooks); `serve_forever` in the foreground.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from jaxinfer.config_file import NonNegative, load_config, schema
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.serve.app import BodyLimit, ServeState, create_app


@schema("serve.")
class ServeOptions:
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, lt=65536)] = 8000
    served_model_name: str | None = None  # default: engine.model
    # Requests accepted beyond the engine's batch (in sequences: n samples count n) before
    # the server answers 429 (Retry-After); the queue never grows past it.
    max_queue: NonNegative = 256
    max_body_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    chat_template: str | None = None  # a Jinja file; default: the model's own
    log_level: str = "info"


@dataclass
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    serve: ServeOptions = field(default_factory=ServeOptions)


def load_serve_config(path: str | Path | None, overrides: Seq[str] = ()) -> ServeConfig:
    """Schema <- the YAML's `engine` and `serve` sections <- dotted overrides; a ValueError
    names the key."""
    sc = load_config(ServeConfig, path, overrides, what="serve",
                     select=lambda f: {k: f[k] for k in ("engine", "serve") if k in f})  # fmt: skip
    return sc


def build_llm(sc: ServeConfig, progress=None) -> LLM:
    """The model and its engine, warmed up (every batch shape compiled: none compiles later);
    `progress(done, total)` as the executables compile."""
    e = sc.engine
    if e.data_parallel > 1 or e.data_parallel_backend == "process":
        raise ValueError(f"engine.data_parallel={e.data_parallel}: the server drives one engine "
                         f"in this process (run one server per replica behind a load balancer)")  # fmt: skip
    kwargs = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name != "model"}
    llm = LLM(e.model, progress=progress, **kwargs)
    if sc.serve.chat_template is not None:
        llm.chat_template = Path(sc.serve.chat_template).read_text()
    return llm


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one, read back from `getsockname`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server:
    """An HTTP server over `llm` in background threads: `start()`, `base_url`, `stop()`."""

    def __init__(self, llm: LLM, options: ServeOptions | None = None) -> None:
        import uvicorn

        self.options = options or ServeOptions(port=0)
        name = self.options.served_model_name or llm.config.model
        self.state = ServeState(llm, name, self.options.max_queue)
        self.app = create_app(self.state)
        self.sock = bind(self.options.host, self.options.port)
        config = uvicorn.Config(BodyLimit(self.app, self.options.max_body_bytes),
                                log_level=self.options.log_level, timeout_graceful_shutdown=2,
                                lifespan="on")  # fmt: skip
        server, state = self, self.state
        self.streams_ended = 0
        self.signals: list[int] = []  # the signals that stopped serve_forever, in order

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame):
                server.signals.append(sig)
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets=None):
                # SIGINT/SIGTERM: end the open streams first, so that they finish within the
                # graceful timeout rather than being cancelled mid-stream
                server.streams_ended = state.end_streams()
                await super().shutdown(sockets)
                # uvicorn re-raises the signals it caught once it is down, but a SIGINT raised
                # there can reach asyncio's runner after its task is done and be lost (the
                # process then exited 0); the caller reads `server.signals` instead
                getattr(self, "_captured_signals", []).clear()

        self.uvicorn = _Uvicorn(config)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def base_url(self) -> str:
        host = self.options.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    @property
    def engine_loop(self):
        return self.state.engine_loop

    def serve_forever(self) -> None:
        """Serve until stopped: `stop()`, or SIGINT/SIGTERM in the main thread (then listed in
        `signals`; the signal is not re-raised)."""
        self.uvicorn.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> Server:
        self._thread = threading.Thread(target=self.serve_forever, name="jaxinfer-http",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
