"""The shipped reference models: transformers agrees on their logits, and they have learned."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.assets import REFERENCE_MODELS, reference_model_dir
from jaxinfer.checkpoint import load_hf_model, load_tokenizer
from jaxinfer.models.dense import forward
from jaxinfer.train.evaluate import heldout_perplexity


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_shipped_model_logits_match_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = reference_model_dir(name)
    cfg, params = load_hf_model(path, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        expected = hf(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", REFERENCE_MODELS)
def test_shipped_model_heldout_perplexity_is_far_below_uniform(name):
    result = heldout_perplexity(reference_model_dir(name), max_windows=32)
    # A model that learned nothing scores about the vocabulary size (4096) or worse.
    assert result["perplexity"] < result["uniform_perplexity"] / 40, result


def test_tiny_and_its_draft_share_one_tokenizer():
    a = load_tokenizer(reference_model_dir("tiny")).get_vocab()
    b = load_tokenizer(reference_model_dir("tiny-draft")).get_vocab()
    assert a == b


def test_unknown_reference_model_is_a_clear_error():
    with pytest.raises(ValueError, match="tiny"):
        reference_model_dir("huge")


def test_english_text_is_the_docs_topics_then_heldout_docstrings_and_scores_by_name():
    from pydoc_data.topics import topics

    from jaxinfer.train.corpus import english_texts, stdlib_corpus

    corpus = stdlib_corpus()
    texts = english_texts(corpus)
    assert texts[: len(topics)] == [topics[k] for k in sorted(topics)]
    docstrings = texts[len(topics) :]
    assert docstrings and all(d.strip() for d in docstrings)
    heldout = "".join(f.read_text() for f in (corpus.root / p for p in corpus.heldout))
    assert all(d.splitlines()[0] in heldout for d in docstrings)  # from held-out files only
    row = heldout_perplexity("tiny", text="english", max_windows=16)  # a name, not a directory
    assert row["model"] == "tiny" and row["text"] == "english", row
    assert row["perplexity"] < row["uniform_perplexity"] / 10, row
    with pytest.raises(ValueError, match="text='prose' is not one of"):
        heldout_perplexity("tiny", text="prose")
