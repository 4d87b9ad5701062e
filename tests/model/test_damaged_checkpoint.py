"""Damaged checkpoints a learner meets (a download cut short, a Git LFS pointer, a hand-edited
file) raise labkit's CheckpointError naming the file and what to do, never a library's raw error."""

import json
import shutil

import pytest

from labkit.model import CheckpointError, ConfigError, load_pretrained
from labkit.model.loader import load_model, resolve_model_path


@pytest.fixture
def ckpt(tmp_path):
    src = resolve_model_path("labkit-tiny")
    dst = tmp_path / "tiny"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("keep", [0.5, 0.999, 100])
def test_truncated_safetensors(ckpt, keep):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert str(f) in msg and "truncated or corrupt" in msg and "copy or download it again" in msg


def test_garbage_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 4096)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(ckpt)


def test_git_lfs_pointer_says_git_lfs_pull(ckpt):
    (ckpt / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 10563928\n")
    with pytest.raises(CheckpointError, match="git lfs pull"):
        load_model(ckpt)


def test_bad_shard_index(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is truncated"):
        load_model(ckpt)


def test_tokenizer_problems_name_the_file(ckpt):
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json is truncated or corrupt"):
        load_pretrained(ckpt)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_pretrained(ckpt)


def test_bad_tokenizer_config(ckpt):
    (ckpt / "tokenizer_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is truncated or corrupt"):
        load_pretrained(ckpt)


def test_unsupported_config_names_the_file(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="config.json: .*hidden_size"):
        load_model(ckpt)
