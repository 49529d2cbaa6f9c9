"""Tensor parallelism on the engine mesh's "model" axis: what the sharding rules alone do not do.

The rules table (`sharding.DEFAULT_RULES`) places every weight Megatron-style: `w_qkv` by KV head
(each KV head's query heads, key and value stay on one device), `wo` by its input heads,
`w_gate_up` by the FFN dim, `w_down` by its input, the embedding and LM head by vocab, the KV
pages by KV head. XLA's partitioner then inserts one all-reduce after `wo` and one after
`w_down`. The checkpoint loaders put each tensor straight onto its shards (`hf_loader`). Three
things need more than placement:

- **Attention runs per device** (`models.attention.write_kv_and_attend` under `shard_map`): the
  Pallas kernel cannot be partitioned by XLA, and each device holds only its KV heads' pages, so
  each device attends its own heads and never sees another's (`attention_mesh`).
- **Fewer KV heads than model devices** (8 KV heads on 16 devices; tiny's 2 on 4): the KV heads
  cannot be split, so each is replicated `r = devices / KV heads` times and its query heads are
  divided among the copies (`fit_kv_heads_to_mesh`). Copy i of KV head h holds the key and value
  of h and query heads h * G + i * G / r ... + G / r - 1 of its G; query heads keep their global
  order, so `wo` is unchanged. The math is the same model's (each query head still attends its
  own KV head); the cost is r copies of those K/V pages, one per device (vLLM replicates the
  same way when the tensor-parallel size exceeds the KV heads).
- **Sampling per vocab shard** (`parallel/vocab.py`, `sampler.sample(mesh=)`): the logits stay
  sharded by vocab as the LM head makes them; greedy tokens, the token's logprob and the top
  logprobs are per-shard max / argmax, logsumexp and top-k combined across the axis, so a step
  moves [S]- and [S, T * k]-sized values, never an [S, V] row. Penalties apply on each shard's
  slice. A batch in which some row samples (temperature > 0) gathers its rows: the filters sort
  the whole vocabulary. A vocabulary the axis does not divide is replicated (the LM head too),
  and sampled as on one device.
With a model axis of 1 none of this runs: no shard_map, the one-device code.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.models.config import ModelConfig

AXIS = "model"


def model_axis_size(mesh: Mesh | None) -> int:
    """Devices on the mesh's "model" axis (1 without a mesh or that axis)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(AXIS, 1))


def attention_mesh(cfg: ModelConfig, mesh: Mesh | None) -> Mesh | None:
    """The mesh attention runs per device on (under shard_map over "model"), or None: no model
    axis, or one the KV heads do not divide (then `fit_kv_heads_to_mesh` has not run)."""
    t = model_axis_size(mesh)
    if t == 1 or cfg.num_kv_heads % t:
        return None
    return mesh


def kv_head_copies(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """How many times each KV head is replicated for `mesh` (1: the model axis divides them).
    ValueError naming the mesh when neither it divides the KV heads nor they divide it."""
    t = model_axis_size(mesh)
    hkv, hq = cfg.num_kv_heads, cfg.num_heads
    if hkv % t == 0:
        return 1
    if t % hkv or hq % t:
        raise ValueError(f"engine.mesh model={t} cannot split this model's attention: it has "
                         f"{hkv} KV heads and {hq} query heads, and the model axis must divide "
                         f"the KV heads, or be a multiple of them that divides the query heads "
                         f"(each KV head is then replicated)")  # fmt: skip
    return t // hkv


def replicate_kv_heads(cfg: ModelConfig, params, copies: int):
    """(config, params) of the same model with each KV head replicated `copies` times and its
    query heads divided among the copies (see the module docstring); `copies` must divide the
    query heads per KV head."""
    if copies == 1:
        return cfg, params
    g = cfg.num_heads // cfg.num_kv_heads
    if g % copies:
        raise ValueError(f"{copies} copies of each KV head must divide its {g} query heads")

    def split(w: jax.Array, lead: int) -> jax.Array:
        # [..., Hkv, G + 2, D] -> [..., Hkv * copies, G / copies + 2, D]
        if not isinstance(w, jax.Array):
            raise ValueError("replicating KV heads needs plain (unquantized) w_qkv / b_qkv "
                             f"weights, got {type(w).__name__}: quantize after placing them "
                             "on the mesh")  # fmt: skip
        shape = w.shape
        q = w[..., :g, :].reshape(*shape[:lead], shape[lead] * copies, g // copies, shape[-1])
        kv = jnp.repeat(w[..., g:, :], copies, axis=lead)
        return jnp.concatenate([q, kv], axis=lead + 1)

    layers = []
    for p in params["layers"]:
        p = dict(p)
        p["w_qkv"] = split(p["w_qkv"], 1)
        if "b_qkv" in p:
            p["b_qkv"] = split(p["b_qkv"], 0)
        layers.append(p)
    new_cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)
    return new_cfg, {**params, "layers": tuple(layers)}


def fit_kv_heads_to_mesh(cfg: ModelConfig, params, mesh: Mesh | None):
    """(config, params) whose KV heads the mesh's "model" axis divides (replicated if needed)."""
    return replicate_kv_heads(cfg, params, kv_head_copies(cfg, mesh))
