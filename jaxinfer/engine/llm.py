"""Offline API: `LLM(...).generate(prompts, SamplingParams(...))` and a streaming iterator."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import fields

import jax
import numpy as np

from jaxinfer.engine.chat import render_chat
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.data_parallel import ProcessDataParallelEngine
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model, model_chat_template, model_tokenizer
from jaxinfer.engine.outputs import RequestOutput, StreamEvent
from jaxinfer.engine.request import SamplingParams, Sequence, is_int
from jaxinfer.parallel.sharding import EngineShardings


def _as_prompt_list(prompts) -> list:
    """The prompts of a call: a str, a list of token ids or a 1-D integer array is one prompt;
    another list or tuple holds several; anything else is one (bad) prompt that fails alone."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        return [prompts]
    if isinstance(prompts, list | tuple):
        return [prompts] if prompts and is_int(prompts[0]) else list(prompts)
    return [prompts]


class LLM:
    """A model plus an engine. `LLM("tiny")`, `LLM("smollm2")`, `LLM("preset:llama3-8b",
    dtype="bfloat16")`, `LLM("/path/to/hf_dir", max_num_seqs=64)`, `LLM("model.gguf")`; keyword
    arguments are `EngineConfig` fields."""

    def __init__(self, model: str = "tiny", *, warmup: bool = True, setup=None, progress=None,
                 **engine_kwargs) -> None:  # fmt: skip
        """`setup(engine)` (optional, picklable for the process backend) runs on every engine
        before warm-up; `progress(done, total)` (optional, e.g. `jaxinfer.progress.
        CompileProgress`) is called as the warm-up's executables finish compiling."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.chat_template = model_chat_template(model)
        backend = self.config.data_parallel_backend
        if backend == "process" or (backend == "auto" and self.config.data_parallel > 1):
            if jax.distributed.is_initialized():
                raise ValueError(f"engine.data_parallel={self.config.data_parallel} (separate "
                                 "replicas) is not combined with a multi-host engine: run one "
                                 "multi-host launch per replica")  # fmt: skip
            # Workers load the model on their own GPUs; this process touches no device.
            self.tokenizer = model_tokenizer(model)
            self.engine = ProcessDataParallelEngine(self.config, setup=setup)
            if warmup:
                self.engine.warmup()
            return
        mesh = EngineShardings.for_config(self.config.mesh).mesh
        cfg, params, self.tokenizer = load_model(model, self.config.dtype, self.config.seed, mesh,
                                                 self.config.quant)  # fmt: skip
        self.engine = Engine(self.config, cfg, params, self.tokenizer)
        if setup is not None:
            setup(self.engine)
        if warmup:
            self.engine.warmup(progress=progress)

    def close(self) -> None:
        """End the other processes of a multi-host engine (`Engine.close`); nothing else."""
        if isinstance(self.engine, Engine):
            self.engine.close()

    def _submit(self, prompts, sampling) -> list[Sequence]:
        """Queue every prompt; a bad one (or its sampling) fails alone, with its error."""
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling, list | tuple):
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling)
        else:  # one for all (a str or dict there fails every request, naming it)
            params = [sampling] * len(prompts)
        self._n = len(prompts)
        return [
            self.engine.add_request(p, SamplingParams() if s is None else s)
            for p, s in zip(prompts, params, strict=True)
        ]

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order; a bad request has `error` set and the others still finish."""
        if isinstance(self.engine, ProcessDataParallelEngine):  # workers made the outputs
            self._submit(prompts, sampling)
            return self.engine.run()[-self._n :]
        seqs = self._submit(prompts, sampling)
        while self.engine.has_unfinished():
            self.engine.step()
        outputs = [RequestOutput.of(s, self.tokenizer) for s in seqs]
        self.engine.release(seqs)  # the outputs hold what the caller gets: memory stays bounded
        return outputs

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        """The prompt text of one conversation ([{"role", "content"}, ...]) under the model's
        chat template."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer for chat messages")
        cfg = self.engine.model_config if isinstance(self.engine, Engine) else None
        special = {}
        for name, ids in (("bos_token", [cfg.bos_token_id] if cfg else []),
                          ("eos_token", list(cfg.eos_token_ids[:1]) if cfg else [])):  # fmt: skip
            if ids and ids[0] is not None:
                special[name] = self.tokenizer.id_to_token(ids[0])
        return render_chat(self.chat_template, messages,
                           add_generation_prompt=add_generation_prompt, special_tokens=special)  # fmt: skip

    def chat(
        self,
        messages,
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Replies to one conversation ([{"role", "content"}, ...]) or a list of them, each
        rendered with the model's chat template; a conversation the template refuses fails alone,
        as a bad prompt does."""
        many = isinstance(messages, list | tuple) and bool(messages)
        many = many and isinstance(messages[0], list | tuple)
        prompts, refused = [], {}
        for i, conversation in enumerate(messages if many else [messages]):
            try:
                prompts.append(self.render_chat(conversation))
            except ValueError as e:
                refused[i] = RequestOutput(-1, None, [], [], None, "error", f"conversation {i}: "
                                           f"{e}", [], 0)  # fmt: skip
        if isinstance(sampling, list | tuple):
            sampling = [s for i, s in enumerate(sampling) if i not in refused]
        replies = iter(self.generate(prompts, sampling) if prompts else [])
        return [refused[i] if i in refused else next(replies)
                for i in range(len(prompts) + len(refused))]  # fmt: skip

    def stream(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield tokens as the engine produces them (several per event after a decode scan).
        A request leaves the engine once all its samples have finished (as `generate` releases
        them); a stream closed early (the consumer stopped) aborts and releases the rest."""
        if isinstance(self.engine, ProcessDataParallelEngine):
            raise NotImplementedError("streaming with engine.data_parallel > 1 is not supported")
        seqs = self._submit(prompts, sampling)
        try:
            for seq in seqs:
                if seq.error is not None:
                    self.engine.release([seq])
                    yield StreamEvent(seq.seq_id, [], True, seq.finish_reason, seq.error)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.new_token_ids or out.finished:
                        s = out.seq
                        root = s.parent or s
                        if out.finished and all(x.is_finished for x in (root, *root.siblings)):
                            self.engine.release([root])
                        yield StreamEvent(root.seq_id, out.new_token_ids, out.finished,
                                          s.finish_reason, s.error, s.sample_index)  # fmt: skip
        finally:
            for seq in seqs:  # (finished ones are skipped, and released ones are gone)
                self.engine.abort(seq)
            self.engine.release(seqs)
