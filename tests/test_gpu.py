"""Checks that need an NVIDIA GPU (run on the device machine with `pytest -m gpu`)."""

from __future__ import annotations

import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.generate import greedy_generate
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params, num_params

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


def test_llama3_8b_initialises_on_device_without_host_copy():
    cfg = preset("llama3-8b")
    # Start the GPU runtime and the compiler first: loading CUDA libraries alone grows host RSS.
    jax.block_until_ready(init_params(preset("tiny"), jax.random.key(0)))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = init_params(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    leaves = jax.tree.leaves(params)
    assert all(leaf.devices() == {jax.devices()[0]} for leaf in leaves)
    assert sum(leaf.nbytes for leaf in leaves) == 2 * num_params(cfg)  # bf16, about 16 GB
    # Peak RSS: a transient host copy of the weights (16 GB) would show here too.
    assert rss_after - rss_before < 4e9, "host memory grew: weights went through the host"


def test_paged_greedy_decode_matches_full_forward_on_gpu():
    cfg = preset("tiny-qwen3")
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 33)]
    with jax.default_matmul_precision("highest"):  # no TF32: the two paths must agree on argmax
        outs = greedy_generate(params, cfg, prompts, 16, page_size=16, shuffle_pages_seed=0)
        for prompt, out in zip(prompts, outs, strict=True):
            ref = jnp.argmax(forward(params, cfg, jnp.asarray([prompt + out]))[0], axis=-1)
            assert np.asarray(ref)[len(prompt) - 1 : -1].tolist() == out
