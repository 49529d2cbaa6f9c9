"""Damaged checkpoints fail at load, naming the file and the array (issue 25, "Checkpoints").

orbax: truncated/emptied array files, flipped bytes (caught by the checksums recorded at save),
NaN/inf weights, a config that no longer describes the saved arrays. HF safetensors: NaN/inf
tensors, a num_hidden_layers smaller than the file's layers. Tokenizers: a tokenizer.json that
cannot be read. Every corruption is drawn from a seed printed in the failure message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import spine_parts
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoint import (
    CheckpointError,
    load_hf_model,
    load_tokenizer,
    restore_params,
    save_params,
)
from jaxinfer.checkpoint.errors import UnverifiedCheckpointWarning
from jaxinfer.checkpoint.orbax_io import CHECKSUMS_FILE, CONFIG_FILE, PARAMS_DIR, config_to_dict
from jaxinfer.engine.loading import load_model, model_tokenizer
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import abstract_params

FORMAT = spine_parts.CHANNEL_SCALED.name

# A failed orbax restore abandons its other in-flight reads; the garbage collector later reports
# each as "Exception ignored in: <coroutine ...>" (orbax's, after our CheckpointError was raised).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def param_paths(tree) -> list[str]:
    """`layers[1].w_qkv`-style paths written out here, not with the code under test."""
    out = []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in keypath:
            if isinstance(k, jax.tree_util.SequenceKey):
                parts.append(f"[{k.idx}]")
            else:
                parts.append("." + str(getattr(k, "key", getattr(k, "name", k))))
        out.append("".join(parts).lstrip("."))
    return out


def host_checksums(x) -> dict[str, int]:
    """Reference of the device checksums: numpy over the array's bits (uint64 wraps mod 2**64,
    a multiple of 2**32)."""
    a = np.asarray(x)
    words = a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).ravel().astype(np.uint64)
    weights = 2 * np.arange(words.size, dtype=np.uint64) + 1
    return {"sum": int(words.sum() % 2**32), "weighted_sum": int((words * weights).sum() % 2**32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, channel_scaled_format):
    """(checkpoint dir, cfg, params) of a tiny model with a weight format (QuantizedWeight nodes)
    and mixed dtypes (bf16 values, fp32 scales and norms). The format is registered until the
    module's last test (restoring names it too)."""
    cfg = preset("tiny", weight_format=FORMAT, param_dtype="bfloat16")
    rng = np.random.default_rng(7)
    params = jax.tree.map(
        lambda s: jax.numpy.asarray(rng.standard_normal(s.shape), s.dtype), abstract_params(cfg)
    )
    path = tmp_path_factory.mktemp("orbax") / "ck"
    save_params(path, cfg, params)
    return path, cfg, params


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def data_files(ck: Path) -> list[Path]:
    """orbax's OCDBT data files, largest first (they hold the arrays' chunks)."""
    files = [p for p in (ck / PARAMS_DIR).rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: (-p.stat().st_size, p.name))


def assert_same_params(a, b, msg: str = "") -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), msg
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=msg)


# --- orbax: checksums ---------------------------------------------------------------------------


def test_checksums_file_is_keyed_by_param_path_and_matches_a_host_reference(saved):
    path, _, params = saved
    recorded = json.loads((path / CHECKSUMS_FILE).read_text())["arrays"]
    names = param_paths(params)
    assert list(recorded) == names
    assert "layers[1].w_qkv.arrays.values" in recorded and "layers[0].attn_norm" in recorded
    for name, x in zip(names, jax.tree.leaves(params), strict=True):
        want = {"dtype": str(x.dtype), "shape": list(x.shape), **host_checksums(x)}
        assert recorded[name] == want, name


def test_restored_params_equal_the_saved_ones_without_warning(saved):
    path, cfg, params = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedCheckpointWarning)
        cfg2, params2 = restore_params(path)
    assert cfg2 == cfg
    assert_same_params(params2, params)


def test_checkpoint_without_checksums_restores_with_a_warning(saved, tmp_path):
    path = copy_of(saved[0], tmp_path / "old")
    (path / CHECKSUMS_FILE).unlink(missing_ok=True)
    with pytest.warns(UnverifiedCheckpointWarning, match=CHECKSUMS_FILE):
        _, params = restore_params(path)
    assert_same_params(params, saved[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flipped_bytes_that_orbax_restores_silently_are_refused_by_checksum(saved, tmp_path, seed):
    """Flip bytes (same file size) until orbax restores different values without an error when
    the checksums are gone; with them, the restore is refused naming the first changed array."""
    rng = np.random.default_rng(seed)
    src, _, params = saved
    names = param_paths(params)
    for attempt in range(20):
        ck = copy_of(src, tmp_path / f"ck{attempt}")
        file = data_files(ck)[0]  # the largest holds weight chunks (see the truncation test)
        data = bytearray(file.read_bytes())
        at = int(rng.integers(len(data) // 4, len(data) - 16))
        for i in range(at, at + int(rng.integers(1, 9))):
            data[i] ^= int(rng.integers(1, 256))
        file.write_bytes(bytes(data))
        unverified = copy_of(ck, tmp_path / f"unverified{attempt}")
        (unverified / CHECKSUMS_FILE).unlink(missing_ok=True)  # (none before checksums)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _, restored = restore_params(unverified)
            except CheckpointError:
                continue  # zstd or TensorStore noticed this one; draw another
        assert [w.category for w in caught] == [UnverifiedCheckpointWarning], f"seed {seed}"
        changed = [
            name
            for name, a, b in zip(
                names, jax.tree.leaves(restored), jax.tree.leaves(params), strict=True
            )
            if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
        ]
        if changed:
            break
    else:
        pytest.fail(f"seed {seed}: no silent corruption in 20 draws")
    with pytest.raises(CheckpointError) as err:
        restore_params(ck)
    msg = str(err.value)
    assert f"array {changed[0]} does not match its checksum" in msg, f"seed {seed}: {msg}"
    assert str(ck) in msg, f"seed {seed}: {msg}"


# --- orbax: unreadable files --------------------------------------------------------------------


@pytest.mark.parametrize(("damage", "seed"), [("truncated", 3), ("truncated", 4), ("emptied", 5)])
def test_truncated_or_emptied_orbax_file_is_one_short_error_naming_the_array(
    saved, tmp_path, damage, seed
):
    rng = np.random.default_rng(seed)
    ck = copy_of(saved[0], tmp_path / "ck")
    # the largest data file always holds array chunks; smaller ones may hold only b-tree nodes a
    # later merge superseded (how orbax splits its writes into files varies from run to run)
    file = data_files(ck)[0]
    data = file.read_bytes()
    file.write_bytes(data[: int(rng.integers(1, len(data) - 1))] if damage == "truncated" else b"")
    with pytest.raises(CheckpointError) as err:
        restore_params(ck)
    msg = str(err.value)
    lines = msg.splitlines()
    context = f"seed {seed}, {damage} {file.name}: {msg}"
    assert len(lines) == 2 and len(msg) < 800 and "TensorStore" not in msg, context
    assert lines[0].startswith(f"cannot restore checkpoint {ck}: array "), context
    named = lines[0].split(": array ")[1].split(" ")[0]
    assert named in param_paths(saved[2]), context
    # the cause is TensorStore's own line about that same array (orbax names it layers.1.wo)
    assert lines[1].startswith("cause: ") and named.replace("[", ".").replace("]", "") in lines[1]
    assert err.value.__cause__ is None and err.value.__suppress_context__, context


def test_config_that_does_not_describe_the_saved_arrays_is_one_line(saved, tmp_path):
    ck = copy_of(saved[0], tmp_path / "ck")
    config = json.loads((ck / CONFIG_FILE).read_text())
    config["num_layers"] = 1
    (ck / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        restore_params(ck)
    msg = str(err.value)
    assert "\n" not in msg and "saved but not in the config: layers[1].attn_norm" in msg, msg


# --- orbax: non-finite weights ------------------------------------------------------------------


def _write_unchecked(path: Path, cfg, params) -> None:
    """A checkpoint as save_params wrote it before this change: no checksums, no checks."""
    path.mkdir()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((path / PARAMS_DIR).absolute(), params)
        checkpointer.wait_until_finished()
    (path / CONFIG_FILE).write_text(json.dumps(config_to_dict(cfg)))


@pytest.mark.parametrize(("seed", "value"), [(6, np.nan), (7, np.inf), (8, -np.inf)])
def test_nonfinite_weight_in_orbax_checkpoint_is_refused_by_param_path(
    saved, tmp_path, seed, value
):
    rng = np.random.default_rng(seed)
    _, cfg, params = saved
    names, leaves = param_paths(params), jax.tree.leaves(params)
    i = int(rng.integers(len(leaves)))
    bad = np.array(leaves[i])
    bad.flat[rng.integers(bad.size)] = value
    leaves[i] = jax.numpy.asarray(bad)
    poisoned = jax.tree.unflatten(jax.tree.structure(params), leaves)
    with pytest.raises(ValueError, match=re.escape(f"array {names[i]} holds 1 NaN/inf")):
        save_params(tmp_path / "refused", cfg, poisoned)
    assert not (tmp_path / "refused").exists(), f"seed {seed}"
    _write_unchecked(tmp_path / "old", cfg, poisoned)
    with pytest.raises(CheckpointError) as err, pytest.warns(UnverifiedCheckpointWarning):
        restore_params(tmp_path / "old")
    assert f"array {names[i]} holds 1 NaN/inf values" in str(err.value), f"seed {seed}: {err.value}"


def test_restore_onto_a_mesh_verifies_the_checksums_saved_on_one_device(saved, run_on_cpu_devices):
    """The checksums are the same for the sharded restore (integer sums in any order)."""
    path, _, _ = saved
    code = f"""
        import sys, warnings, jax, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import spine_parts
        from jaxinfer.checkpoint import restore_params
        from jaxinfer.parallel.sharding import make_mesh
        from jaxinfer.quant import register_format
        register_format(spine_parts.CHANNEL_SCALED)  # the checkpoint names it (this process only)
        warnings.simplefilter("error")
        _, single = restore_params({str(path)!r})
        _, sharded = restore_params({str(path)!r}, mesh=make_mesh({{"data": 1, "model": 2}}))
        assert len(sharded["layers"][0]["w_qkv"].arrays["values"].sharding.device_set) == 2
        for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        print("ok")
        """
    run_on_cpu_devices(code, 2)


# --- HF safetensors -----------------------------------------------------------------------------

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with q/k/v biases, saved by transformers as one file and as shards."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return {"single": root / "single", "sharded": root / "sharded"}


def rewrite(src: Path, dst: Path, mutate) -> Path:
    """A copy of the single-file checkpoint `src` with `mutate(tensors)` applied."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    ("seed", "hf_name", "param", "value"),
    [
        (10, "model.layers.1.self_attn.k_proj.weight", "layers[1].w_qkv", np.nan),
        (11, "model.layers.0.self_attn.v_proj.bias", "layers[0].b_qkv", np.inf),
        (12, "model.layers.0.self_attn.o_proj.weight", "layers[0].wo", -np.inf),
        (13, "model.embed_tokens.weight", "embed", np.nan),
        (14, "model.norm.weight", "final_norm", np.nan),
    ],
)
def test_nonfinite_hf_tensor_is_refused_naming_it_and_its_param(
    hf_dirs, tmp_path, seed, hf_name, param, value
):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 4))

    def poison(tensors):
        flat = tensors[hf_name].reshape(-1)
        flat[rng.choice(flat.size, count, replace=False)] = value

    path = rewrite(hf_dirs["single"], tmp_path / "ck", poison)
    with pytest.raises(CheckpointError) as err:
        load_hf_model(path, dtype="float32")
    want = f"tensor {hf_name!r} (for param {param}) in {path / 'model.safetensors'} holds {count}"
    assert want in str(err.value), f"seed {seed}: {err.value}"


def test_weights_out_of_range_of_the_load_dtype_are_refused(hf_dirs, tmp_path):
    seed = 15
    rng = np.random.default_rng(seed)
    name = "model.layers.1.mlp.up_proj.weight"

    def enlarge(tensors):
        tensors[name].reshape(-1)[rng.integers(tensors[name].size)] = 1e6  # > float16's 65504

    path = rewrite(hf_dirs["single"], tmp_path / "ck", enlarge)
    load_hf_model(path, dtype="float32")  # finite in float32
    with pytest.raises(CheckpointError, match=r"layers\[1\]\.w_gate_up.*up_proj.*float16"):
        load_hf_model(path, dtype="float16")


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_fewer_config_layers_than_the_checkpoint_holds_are_refused_unless_allowed(
    hf_dirs, tmp_path, layout
):
    path = copy_of(hf_dirs[layout], tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_hf_model(path, dtype="float32")
    msg = str(err.value)
    # layer 1: q/k/v/o weights and biases, gate/up/down, two norms
    assert "holds 13 tensors of layer(s) 1, beyond the config's num_hidden_layers=1" in msg, msg
    assert "'model.layers.1.input_layernorm.weight'" in msg and "allow_unused_layers=True" in msg
    cfg, params = load_hf_model(path, dtype="float32", allow_unused_layers=True)
    _, full = load_hf_model(hf_dirs[layout], dtype="float32")
    assert cfg.num_layers == 1 and len(params["layers"]) == 1
    assert_same_params(params["layers"][0], full["layers"][0])
    assert_same_params(params["lm_head"], full["lm_head"])


def test_unused_tensors_outside_missing_layers_are_still_ignored(hf_dirs, tmp_path):
    def add_buffers(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        tensors["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    path = rewrite(hf_dirs["single"], tmp_path / "ck", add_buffers)
    _, params = load_hf_model(path, dtype="float32")
    _, plain = load_hf_model(hf_dirs["single"], dtype="float32")
    assert_same_params(params, plain)


# --- tokenizer ----------------------------------------------------------------------------------


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


@pytest.mark.parametrize("damage", ["truncated", "empty", "binary", "not a tokenizer", "dangling"])
def test_unreadable_tokenizer_json_is_an_error_at_load_naming_the_file(hf_dirs, tmp_path, damage):
    seed = 20
    rng = np.random.default_rng(seed)
    path = copy_of(hf_dirs["single"], tmp_path / "ck")
    file = path / "tokenizer.json"
    good = _tokenizer_json()
    if damage == "dangling":
        os.symlink(tmp_path / "elsewhere.json", file)
    else:
        file.write_bytes(
            {
                "truncated": good[: int(rng.integers(1, len(good) - 1))].encode(),
                "empty": b"",
                "binary": rng.bytes(64),
                "not a tokenizer": b'{"version": "1.0"}',
            }[damage]
        )
    with pytest.raises(CheckpointError, match=str(file)) as err:
        model_tokenizer(str(path))
    assert "\n" not in str(err.value).strip(), f"seed {seed}: {err.value}"
    with pytest.raises(CheckpointError, match=str(file)):
        load_model(str(path))


def test_checkpoint_without_tokenizer_json_loads_without_a_tokenizer(hf_dirs, tmp_path):
    path = copy_of(hf_dirs["single"], tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model_tokenizer(str(path)) is None
        assert load_model(str(path))[2] is None
    (path / "tokenizer.json").write_text(_tokenizer_json())
    assert model_tokenizer(str(path)).encode("hello world").ids == [1, 2]
    assert load_tokenizer(path).encode("world").ids == [2]


def test_tokenizer_files_without_tokenizer_json_warn_that_none_was_loaded(hf_dirs, tmp_path):
    path = copy_of(hf_dirs["single"], tmp_path / "ck")
    (path / "tokenizer_config.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"tokenizer_config\.json but no tokenizer\.json"):
        assert model_tokenizer(str(path)) is None
