"""The engine on a device mesh (`engine.mesh`), on 8 CPU devices faked in a subprocess.

A one-device mesh and a data-only mesh must give the default engine's tokens exactly, a 2-way
`model` axis (params by their logical axes, KV pages by KV head) the same greedy tokens, each with
no compile after warm-up; stacked expert weights shard on an `expert` axis.
"""

from __future__ import annotations

SCRIPT = """
    import json
    import sys
    sys.path.insert(0, "tests")
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import spine_parts
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.models.presets import preset
    from jaxinfer.models.spec import init_params
    from jaxinfer.parallel.sharding import make_mesh

    assert len(jax.devices()) == 8
    seed = 31
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 4000, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    sp = [SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0.8, seed=5)] * 3
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4)
    base = [o.token_ids for o in LLM("tiny", warmup=False, **kw).generate(prompts, sp)]
    for mesh in ({"data": 1, "model": 1}, {"data": 8}, {"data": 2, "model": 2}):
        llm = LLM("tiny", mesh=mesh, **kw)
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        engine = llm.engine
        assert engine.compiles_after_warmup == 0, mesh
        n = int(np.prod(list(mesh.values())))
        pages = engine.runner.kv.pages
        assert len(pages.sharding.device_set) == n, (mesh, pages.sharding)
        w_qkv = engine.runner.params["layers"][0]["w_qkv"]
        if mesh.get("model", 1) > 1:
            assert pages.sharding.spec == P(None, None, None, None, "model"), pages.sharding
            assert w_qkv.sharding.spec == P(None, "model", None, None), w_qkv.sharding
            same = sum(a[:3] == b[:3] for a, b in zip(got, base))  # fp32 sums in another order
            assert same >= 5, (mesh, got, base)
        else:
            assert got == base, (f"seed {seed}", mesh, got, base)

    cfg = preset("tiny", ffn_kinds=("dense", "test_experts"))
    params = init_params(cfg, jax.random.key(0), make_mesh({"data": 2, "expert": 4}))
    experts = params["layers"][1]["w_experts"]
    assert experts.sharding.spec == P("expert", None, None), experts.sharding
    assert len(experts.addressable_shards) == 8 and experts.addressable_shards[0].data.shape[0] == 1
    print("ok")
"""


def test_engine_on_meshes_of_fake_cpu_devices(run_on_cpu_devices):
    run_on_cpu_devices(SCRIPT, 8, timeout=900)
