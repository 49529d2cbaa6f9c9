"""Greedy generation driver, the quickstart command, and tensor-parallel sharding on a fake mesh."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cli import main
from jaxinfer.generate import greedy_generate
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, init_params(cfg, jax.random.key(3))


def test_generation_stops_at_eos_and_matches_full_forward(tiny):
    cfg, params = tiny
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 9).tolist()
    (free_run,) = greedy_generate(params, cfg, [prompt], 12, page_size=4, shuffle_pages_seed=1)
    logits = jax.jit(forward, static_argnums=1)(params, cfg, jnp.asarray([prompt + free_run]))
    ref = jnp.argmax(logits[0], axis=-1)
    assert np.asarray(ref)[len(prompt) - 1 : -1].tolist() == free_run
    eos = free_run[4]
    stop_at = free_run.index(eos)
    (stopped,) = greedy_generate(params, cfg, [prompt], 12, page_size=4, eos_token_ids=(eos,))
    assert stopped == free_run[: stop_at + 1]


@pytest.mark.parametrize(
    ("prompts", "max_new", "match"),
    [
        ([[]], 4, "at least one token"),
        ([[1, 2]], 0, "max_new_tokens"),
        ([[1] * 2040], 16, "context"),
    ],
)
def test_bad_generation_requests_fail_with_a_clear_error(tiny, prompts, max_new, match):
    cfg, params = tiny
    with pytest.raises(ValueError, match=match):
        greedy_generate(params, cfg, prompts, max_new)


@pytest.mark.parametrize("extra", [[], ["--preset", "tiny"]], ids=["shipped-tiny", "random-tiny"])
def test_quickstart_runs_and_self_checks(tmp_path, extra):
    assert main(["quickstart", "--max-new-tokens", "8", "--out", str(tmp_path), *extra]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["paged_vs_full_forward_mismatches"] == 0
    assert metrics["output_tokens"] == 8 * metrics["num_prompts"]
    assert {"device", "jax", "commit", "date", "command"} <= metrics.keys()


def test_tensor_parallel_sharding_on_fake_cpu_mesh_matches_single_device(run_on_cpu_devices):
    """Params sharded over a 2-way `model` axis by their logical axes give the same logits,
    eagerly and under jit (where the layers run as one nested jit)."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from jaxinfer.models.presets import preset
        from jaxinfer.models.spec import init_params
        from jaxinfer.models.dense import forward
        from jaxinfer.parallel.sharding import make_mesh
        cfg = preset("tiny")
        mesh = make_mesh({"data": 2, "model": 2})
        sharded = init_params(cfg, jax.random.key(0), mesh=mesh)
        single = init_params(cfg, jax.random.key(0))
        for name, spec in (("w_qkv", (None, "model", None, None)),
                           ("w_gate_up", (None, None, "model"))):
            w = sharded["layers"][0][name]
            assert w.sharding.spec == jax.sharding.PartitionSpec(*spec), (name, w.sharding)
            assert len({str(s.index) for s in w.addressable_shards}) == 2
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)))
        b = forward(single, cfg, tokens)
        for a in (forward(sharded, cfg, tokens), jax.jit(forward, static_argnums=1)(sharded, cfg, tokens)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        print("ok")
        """
    run_on_cpu_devices(code, 4)
