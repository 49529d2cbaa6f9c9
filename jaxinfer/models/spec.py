"""Abstract description of every weight: shape, dtype, logical axes, initializer.

Random init, sharding and checkpoint loading all derive from `param_specs(cfg)`, so a new weight
is declared once. Parameters are plain nested dicts of arrays (pytrees); a leaf may later become a
quantized pytree (values + scales) without changing the tree's structure above it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.parallel.sharding import DEFAULT_RULES, named_sharding

Init = Literal["normal", "ones", "zeros"]
Params = dict[str, Any]


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: jnp.dtype
    axes: tuple[str | None, ...]
    init: Init = "normal"
    # Standard deviation for "normal": 1/sqrt(fan_in) keeps activations O(1) through random layers.
    scale: float = 1.0

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def is_spec(x: object) -> bool:
    return isinstance(x, ParamSpec)


def layer_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Specs of one decoder layer. Linear weights are stored (in, out): y = x @ w.

    Projections that read the same input are stored fused, so each is one matmul:
    - `w_qkv` [E, Hkv, G + 2, D] (G = Hq / Hkv): for each KV head, its G query heads, then its key
      and its value head. Query head h = kv * G + g is HF's grouping, and sharding the kv_heads axis
      keeps every group's q, k and v together under tensor parallelism.
    - `w_gate_up` [E, 2, F]: gate then up; sharding `mlp` splits both alike.
    Fused, a decode step's gate/up is one matmul of N = 2F (one launch, more tiles per wave) and the
    mixed step needs no runtime concatenation of q/k/v weights; measured in
    `experiments/results/h200/fused_projections.json`. The checkpoint loader and saver split and
    join HF's separate q/k/v and gate/up tensors.
    """
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    g = cfg.q_per_kv
    w, n = cfg.jnp_param_dtype, cfg.jnp_param_dtype

    def dense(shape, axes, fan_in):
        return ParamSpec(shape, w, axes, "normal", 1.0 / math.sqrt(fan_in))

    specs = {
        "attn_norm": ParamSpec((e,), n, ("embed",), "ones"),
        "w_qkv": dense((e, hkv, g + 2, d), ("embed", "kv_heads", None, "head_dim"), e),
        "wo": dense((hq, d, e), ("heads", "head_dim", "embed"), hq * d),
        "mlp_norm": ParamSpec((e,), n, ("embed",), "ones"),
        "w_gate_up": dense((e, 2, f), ("embed", None, "mlp"), e),
        "w_down": dense((f, e), ("mlp", "embed"), f),
    }
    if cfg.qkv_bias:
        specs["b_qkv"] = ParamSpec((hkv, g + 2, d), w, ("kv_heads", None, "head_dim"), "zeros")
    if cfg.o_bias:
        specs["bo"] = ParamSpec((e,), w, ("embed",), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((d,), n, ("head_dim",), "ones")
        specs["k_norm"] = ParamSpec((d,), n, ("head_dim",), "ones")
    if cfg.mlp_bias:
        specs["b_gate_up"] = ParamSpec((2, f), w, (None, "mlp"), "zeros")
        specs["b_down"] = ParamSpec((e,), w, ("embed",), "zeros")
    return specs


def param_specs(cfg: ModelConfig) -> Params:
    """The whole parameter tree as ParamSpecs.

    `layers` is a tuple of per-layer dicts for `layer_loop="unrolled"` and one dict of arrays with
    a leading "layers" axis for `layer_loop="scan"` (see `dense.apply_layers`).
    """
    e, v = cfg.hidden_size, cfg.vocab_size
    one = layer_specs(cfg)
    if cfg.layer_loop == "scan":
        layers: Any = {
            k: ParamSpec((cfg.num_layers, *s.shape), s.dtype, ("layers", *s.axes), s.init, s.scale)
            for k, s in one.items()
        }
    else:
        layers = tuple(dict(one) for _ in range(cfg.num_layers))
    tree: Params = {
        # Tied: the embedding is also the output head, so scale it like one (logits O(1)).
        "embed": ParamSpec(
            (v, e),
            cfg.jnp_param_dtype,
            ("vocab", "embed"),
            "normal",
            1.0 / math.sqrt(e) if cfg.tie_word_embeddings else 1.0,
        ),
        "layers": layers,
        "final_norm": ParamSpec((e,), cfg.jnp_param_dtype, ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = ParamSpec(
            (e, v), cfg.jnp_param_dtype, ("embed", "vocab"), "normal", 1.0 / math.sqrt(e)
        )
    return tree


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))


def abstract_params(cfg: ModelConfig, mesh=None, rules=DEFAULT_RULES) -> Params:
    """ShapeDtypeStructs (with shardings when a mesh is given): the target of loads and restores."""

    def one(s: ParamSpec):
        sharding = named_sharding(mesh, s.axes, s.shape, rules) if mesh is not None else None
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return jax.tree.map(one, param_specs(cfg), is_leaf=is_spec)


def param_shardings(cfg: ModelConfig, mesh, rules=DEFAULT_RULES) -> Params:
    return jax.tree.map(
        lambda s: named_sharding(mesh, s.axes, s.shape, rules), param_specs(cfg), is_leaf=is_spec
    )


def _init_leaf(key: jax.Array, spec: ParamSpec) -> jax.Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, spec.dtype)
    return (spec.scale * jax.random.normal(key, spec.shape, jnp.float32)).astype(spec.dtype)


def _init_tree(specs: Any, key: jax.Array) -> Any:
    """Initialise a tree of ParamSpecs; each leaf's key is folded from its path in `specs`."""
    paths_specs, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    leaves = []
    for path, spec in paths_specs:
        path_id = zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF
        leaves.append(_init_leaf(jax.random.fold_in(key, path_id), spec))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None, rules=DEFAULT_RULES) -> Params:
    """Random parameters created directly on the device(s), with no host copy.

    With per-layer storage, one jitted layer initialiser is reused for every layer (layer i gets
    `fold_in(key, i)`), so compile time does not grow with depth: a single program for all of an
    8B model's 290 weights took 84 s to compile on the H200 (`layer_loop.json`).
    """
    specs = param_specs(cfg)
    shardings = param_shardings(cfg, mesh, rules) if mesh is not None else None
    top_specs = {k: v for k, v in specs.items() if k != "layers"}
    top_shardings = None if shardings is None else {k: shardings[k] for k in top_specs}
    k_top, k_layers = jax.random.split(key)
    params = jax.jit(partial(_init_tree, top_specs), out_shardings=top_shardings)(k_top)
    if cfg.layer_loop == "scan":
        layer_shardings = None if shardings is None else shardings["layers"]
        init = jax.jit(partial(_init_tree, specs["layers"]), out_shardings=layer_shardings)
        params["layers"] = init(k_layers)
    else:
        layer_shardings = None if shardings is None else shardings["layers"][0]
        init = jax.jit(partial(_init_tree, specs["layers"][0]), out_shardings=layer_shardings)
        params["layers"] = tuple(
            init(jax.random.fold_in(k_layers, i)) for i in range(cfg.num_layers)
        )
    return params
