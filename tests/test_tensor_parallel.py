"""Tensor parallelism (`engine.mesh: {model: T}`) on 8 CPU devices faked in a subprocess.

The model's logits on a mesh equal one device's (fp32, <= 1e-5) at TP 2, 4 and 8 and DP x TP 2 x 4,
through a prefill step and a decode step that reads the K/V the first one wrote, with attention
per device under shard_map, and with fewer KV heads than devices (each replicated); the engine's
greedy tokens on such a mesh equal one device's. The attention here is the XLA reference: the
Mosaic GPU kernel's interpreter does not run under a multi-device shard_map (its host-side
buffers are keyed by device: the run failed in an io_callback), so the kernel's per-device path
is checked on several GPUs (the multi-GPU issue).
"""

from __future__ import annotations

import pytest

from jaxinfer.models.presets import preset
from jaxinfer.parallel.sharding import make_mesh
from jaxinfer.parallel.tensor import kv_head_copies

LOGITS = """
    import sys
    sys.path.insert(0, "tests")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.kv.cache import init_kv_cache
    from jaxinfer.models.attention import AttentionConfig
    from jaxinfer.models.batch import build_ragged_batch
    from jaxinfer.models.dense import compute_logits, forward_paged
    from jaxinfer.models.presets import preset
    from jaxinfer.models.spec import init_params, param_shardings
    from jaxinfer.parallel.sharding import make_mesh
    from jaxinfer.parallel.tensor import attention_mesh, fit_kv_heads_to_mesh

    seed = SEED
    rng = np.random.default_rng(seed)
    PAGE, PAGES = 16, 2
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in (5, 13, 9)]
    nxt = [[int(t)] for t in rng.integers(1, 500, 3)]
    page_ids = [[1 + PAGES * s + i for i in range(PAGES)] for s in range(3)]

    def logits(cfg, params, mesh, backend):
        cfg, params = fit_kv_heads_to_mesh(cfg, params, mesh)
        put = jax.device_put
        if mesh is not None:
            params = jax.device_put(params, param_shardings(cfg, mesh))
            rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            put = lambda x: jax.device_put(x, rep)
        kv = init_kv_cache(cfg, 16, PAGE, mesh=mesh)
        att = AttentionConfig(backend, mesh=attention_mesh(cfg, mesh))
        step = jax.jit(lambda p, b, kv: forward_paged(p, cfg, b, kv, attention=att))
        out = []
        for toks, ctx in ((prompts, [0, 0, 0]), (nxt, [len(p) for p in prompts])):
            b = build_ragged_batch(toks, ctx, page_ids, num_tokens=32, num_seqs=4,
                                   pages_per_seq=PAGES, put=put)
            hidden, kv = step(params, b, kv)
            rows = jnp.asarray(np.cumsum([len(t) for t in toks]) - 1)
            out.append(np.asarray(compute_logits(params, cfg, hidden[rows]), np.float32))
        return np.concatenate(out), kv

    for name, over, backend, meshes in CASES:
        cfg = preset(name, **over)
        params = init_params(cfg, jax.random.key(seed % 1000))
        base, _ = logits(cfg, params, None, backend)
        for shape in meshes:
            mesh = make_mesh(shape)
            got, kv = logits(cfg, params, mesh, backend)
            t = shape.get("model", 1)
            assert kv.pages.sharding.spec[4] == "model", (shape, kv.pages.sharding)
            assert kv.pages.shape[4] == max(t, cfg.num_kv_heads), kv.pages.shape
            shard = kv.pages.addressable_shards[0].data
            assert len(kv.pages.addressable_shards) == mesh.size, (shape, kv.pages.sharding)
            assert shard.shape[4] == kv.pages.shape[4] // t, (shape, shard.shape)
            tol = 1e-5
            err = float(np.max(np.abs(got - base)))
            assert err <= tol, (f"seed {seed}", name, over, backend, shape, err)
    print("ok")
"""

ENGINE = """
    import sys
    import numpy as np
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    seed = SEED
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(3, 30, 5)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4)
    base = [o.token_ids for o in LLM("tiny", **kw).generate(prompts, sp)]
    for mesh in ({"model": 4}, {"data": 2, "model": 4}):
        llm = LLM("tiny", mesh=mesh, **kw)  # tiny's 2 KV heads, each on 2 devices
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        assert llm.engine.model_config.num_kv_heads == 4, llm.engine.model_config
        assert llm.engine.compiles_after_warmup == 0, mesh
        assert got == base, (f"seed {seed}", mesh, got, base)
    print("ok")
"""


def test_logits_on_tensor_parallel_meshes_equal_one_devices(run_on_cpu_devices, fresh_seed):
    cases = [
        ("tiny", {}, "xla", [{"model": 2}, {"model": 4}, {"data": 2, "model": 4}]),
        ("tiny", {"num_heads": 8}, "xla", [{"model": 8}]),  # 2 KV heads on 8 devices
    ]
    code = LOGITS.replace("SEED", str(fresh_seed)).replace("CASES", repr(cases))
    run_on_cpu_devices(code, 8, timeout=900)


def test_engine_greedy_tokens_on_a_model_mesh_equal_one_devices(run_on_cpu_devices, fresh_seed):
    run_on_cpu_devices(ENGINE.replace("SEED", str(fresh_seed)), 8, timeout=900)


def test_kv_heads_that_cannot_be_split_are_refused_naming_the_mesh():
    cfg = preset("tiny")  # 4 query heads, 2 KV heads
    assert kv_head_copies(cfg, None) == 1
    with pytest.raises(ValueError, match=r"engine.mesh model=3 cannot split .* 2 KV heads"):
        kv_head_copies(cfg, _FakeMesh(3))
    with pytest.raises(ValueError, match=r"model=8 .* 4 query heads"):
        kv_head_copies(cfg, _FakeMesh(8))
    assert kv_head_copies(cfg, _FakeMesh(4)) == 2
    assert make_mesh({"model": 1}).shape["model"] == 1


class _FakeMesh:
    """Just the `shape` a mesh of `model` devices reports (more devices than this process has)."""

    def __init__(self, model: int):
        self.shape = {"data": 1, "model": model}
