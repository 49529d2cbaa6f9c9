"""Abstract description of every weight: shape, dtype, logical axes, initializer.

Random init, sharding, checkpoint loading and orbax restore targets all derive from
`param_specs(cfg)`, so a new weight is declared once. Parameters are plain nested dicts of arrays
(pytrees): `{"embed", "layers": (layer_0, ...), "final_norm", ["lm_head"]}`, one dict per layer,
whose keys come from that layer's specs (its FFN kind's weights, optional biases and norms). A
linear weight of the layers that `cfg.weight_format_of` gives a format (`weight_format`, or the
first matching pattern of the recipe `weight_formats`) is a `QuantizedWeight` whose leaves are the
ParamSpecs of its arrays (`jaxinfer.quant`), so everything below works on it unchanged. The
embedding, LM head, norms and biases are always plain arrays.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import zlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.ffn import FFN_BLOCKS
from jaxinfer.models.param_spec import ParamSpec, is_spec, linear_spec
from jaxinfer.parallel.sharding import DEFAULT_RULES, named_sharding
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight

Params = dict[str, Any]


def layer_specs(cfg: ModelConfig, layer: int) -> dict[str, ParamSpec]:
    """Specs of decoder layer `layer` (its FFN kind's weights included). Linear weights are stored
    (in, out): y = x @ w.

    Projections that read the same input are stored fused, so each is one matmul:
    - `w_qkv` [E, Hkv, G + 2, D] (G = Hq / Hkv): for each KV head, its G query heads, then its key
      and its value head. Query head h = kv * G + g is HF's grouping, and sharding the kv_heads axis
      keeps every group's q, k and v together under tensor parallelism.
    - the dense FFN's `w_gate_up` [E, 2, F] (`ffn.dense_ffn_specs`).
    Fused, a decode step's gate/up is one matmul of N = 2F (one launch, more tiles per wave) and the
    mixed step needs no runtime concatenation of q/k/v weights (docs/decisions.md). The checkpoint loader and saver split and join HF's tensors.
    """
    e, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    g = cfg.q_per_kv
    w = cfg.jnp_param_dtype
    specs = {
        "attn_norm": ParamSpec((e,), w, ("embed",), "ones"),
        "w_qkv": linear_spec((e, hkv, g + 2, d), w, ("embed", "kv_heads", None, "head_dim")),
        "wo": linear_spec((hq, d, e), w, ("heads", "head_dim", "embed"), in_dims=2),
        "mlp_norm": ParamSpec((e,), w, ("embed",), "ones"),
    }
    if cfg.qkv_bias:
        specs["b_qkv"] = ParamSpec((hkv, g + 2, d), w, ("kv_heads", None, "head_dim"), "zeros")
    if cfg.o_bias:
        specs["bo"] = ParamSpec((e,), w, ("embed",), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((d,), w, ("head_dim",), "ones")
        specs["k_norm"] = ParamSpec((d,), w, ("head_dim",), "ones")
    kind = cfg.layer(layer).ffn
    if kind not in FFN_BLOCKS:
        raise ValueError(f"ModelConfig.ffn_kinds: [{kind!r}] unknown; allowed: {list(FFN_BLOCKS)}")
    specs.update(FFN_BLOCKS[kind].specs(cfg))
    if cfg.has_formats:
        specs = {k: _formatted(cfg, layer, k, s) for k, s in specs.items()}
    return specs


def _formatted(cfg: ModelConfig, layer: int, name: str, spec: ParamSpec):
    """`spec` in the format cfg gives weight `name` of `layer` (`weight_format_of`); norms,
    biases and routers (not linear: in_dims 0) stay plain. Stacked MoE expert weights take no
    format yet: one given to them is refused (a recipe entry can keep them plain)."""
    if _is_expert_stack(spec):
        fmt = cfg.weight_format_of(layer, name)
        if fmt is not None:
            raise ValueError(
                f"ModelConfig: weight format {fmt!r} applies to layers.{layer}.{name}, a stacked "
                "MoE expert weight, and expert weights take no format yet; keep them plain with "
                "a recipe entry first, e.g. weight_formats=[['layers.*.w_expert_*', null]]"
            )
        return spec
    fmt = cfg.weight_format_of(layer, name) if spec.in_dims else None
    return spec if fmt is None else formatted_spec(WEIGHT_FORMATS[fmt], spec)


def _is_expert_stack(spec: ParamSpec) -> bool:
    return bool(spec.axes) and spec.axes[0] == "expert"


def layer_weight_paths(cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """(paths "layers.{i}.{name}" of the layers' linear weights, which formats may store; paths
    of the weights that always stay plain: the layers' norms and biases, and the top-level
    "embed", "final_norm", "lm_head"), of a plain `cfg`: the names recipe patterns match."""
    specs = param_specs(cfg)
    linear, plain = [], [k for k in specs if k != "layers"]
    for i, layer in enumerate(specs["layers"]):
        for name, spec in layer.items():
            quantizable = spec.in_dims or _is_expert_stack(spec)  # (experts: refused by name)
            (linear if quantizable else plain).append(f"layers.{i}.{name}")
    return linear, plain


def formatted_spec(fmt, spec: ParamSpec) -> QuantizedWeight:
    """The spec of linear weight `spec` stored in format `fmt`: a QuantizedWeight of ParamSpecs."""
    return QuantizedWeight(fmt.part_specs(spec), fmt, spec.in_dims)


def check_recipe(cfg: ModelConfig) -> None:
    """Each pattern of `cfg.weight_formats` matches a linear weight of the layers; one that names
    only always-plain weights (embedding, head, norms, biases) says so."""
    linear, plain = layer_weight_paths(cfg.plain())
    for i, (pattern, _) in enumerate(cfg.weight_formats):
        if any(fnmatch.fnmatchcase(p, pattern) for p in linear):
            continue
        named = [p for p in plain if fnmatch.fnmatchcase(p, pattern)]
        if named:
            shown = ", ".join(named[:3]) + (", ..." if len(named) > 3 else "")
            raise ValueError(
                f"ModelConfig.weight_formats[{i}]: pattern {pattern!r} names only weights "
                f"that always stay plain ({shown}: the embedding, LM head, norms and biases "
                "are never quantized); formats apply to the layers' linear weights, e.g. "
                "layers.*.w_qkv"
            )
        names = sorted({p.split(".", 2)[2] for p in linear})
        raise ValueError(
            f"ModelConfig.weight_formats[{i}]: pattern {pattern!r} matches no linear weight "
            f"of the model (they are layers.{{0..{cfg.num_layers - 1}}}.{{"
            f"{', '.join(names)}}})"
        )


def param_specs(cfg: ModelConfig) -> Params:
    """The whole parameter tree as ParamSpecs; `layers` is a tuple of per-layer dicts. A recipe
    pattern that matches no linear weight is refused here (`check_recipe`)."""
    if cfg.weight_formats:
        check_recipe(cfg)
    e, v = cfg.hidden_size, cfg.vocab_size
    tree: Params = {
        # Tied: the embedding is also the output head, so scale it like one (logits O(1)).
        "embed": ParamSpec(
            (v, e),
            cfg.jnp_param_dtype,
            ("vocab", "embed"),
            "normal",
            1.0 / math.sqrt(e) if cfg.tie_word_embeddings else 1.0,
        ),
        "layers": tuple(layer_specs(cfg, i) for i in range(cfg.num_layers)),
        "final_norm": ParamSpec((e,), cfg.jnp_param_dtype, ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = linear_spec((e, v), cfg.jnp_param_dtype, ("embed", "vocab"))
    return tree


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the model's logical weights (a formatted weight counts its logical shape)."""
    return num_params_of(param_specs(cfg.plain()))


def num_params_of(specs: Any) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def param_bytes(cfg: ModelConfig) -> int:
    """Device bytes of the stored params: every array of a formatted weight at its stored shape
    and dtype (4-bit values packed two a byte count one byte per pair), the plain ones as they
    are. `num_params` counts the logical weights instead."""
    specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in specs)


def abstract_params(cfg: ModelConfig, mesh=None, rules=DEFAULT_RULES) -> Params:
    """ShapeDtypeStructs (with shardings when a mesh is given): the target of loads and restores."""

    def one(s: ParamSpec):
        sharding = named_sharding(mesh, s.axes, s.shape, rules) if mesh is not None else None
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return jax.tree.map(one, param_specs(cfg), is_leaf=is_spec)


def param_shardings(cfg: ModelConfig, mesh, rules=DEFAULT_RULES) -> Params:
    return spec_shardings(param_specs(cfg), mesh, rules)


def spec_shardings(specs: Any, mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings of a tree of ParamSpecs (one per array, from its logical axes)."""
    return jax.tree.map(lambda s: named_sharding(mesh, s.axes, s.shape, rules), specs,
                        is_leaf=is_spec)  # fmt: skip


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
    """Random parameters created directly on the device(s) (placed on `mesh`), no host copy.

    Layer i gets `fold_in(key, i)`, and one jitted initialiser serves every layer of the same
    spec, so compile time does not grow with depth (one program for all of an 8B model's weights
    compiled for minutes).
    """
    specs = param_specs(cfg)
    top_specs = {k: v for k, v in specs.items() if k != "layers"}
    k_top, k_layers = jax.random.split(key)
    rules_key = tuple(sorted(rules.items()))
    flat, treedef = jax.tree.flatten(top_specs, is_leaf=is_spec)
    params = _initialiser(treedef, tuple(flat), mesh, rules_key)(k_top)
    layers = []
    for i, layer in enumerate(specs["layers"]):
        flat, treedef = jax.tree.flatten(layer, is_leaf=is_spec)
        init = _initialiser(treedef, tuple(flat), mesh, rules_key)
        layers.append(init(jax.random.fold_in(k_layers, i)))
    params["layers"] = tuple(layers)
    return params


@functools.lru_cache(maxsize=64)
def _initialiser(treedef, flat: tuple, mesh, rules_key: tuple):
    """The jitted initialiser of one spec tree on `mesh`: cached, so every layer of one spec, and
    every model of the same shapes built in this process, reuses one compiled program."""
    tree = jax.tree.unflatten(treedef, list(flat))
    shardings = None if mesh is None else spec_shardings(tree, mesh, dict(rules_key))
    return jax.jit(partial(_init_tree, tree), out_shardings=shardings)
