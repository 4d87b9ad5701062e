"""GPTQ / AWQ checkpoints: what is on disk, round trips, and clear errors on mismatches."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from labkit.quant import (
    CheckpointMismatchError,
    QuantizationError,
    awq_quantize_model,
    gptq_quantize_model,
    load_quantized,
    quantize_model,
    save_quantized,
)
from labkit.quant.linear import AWQLinear, GPTQLinear


@pytest.fixture
def gptq_model(tiny, calib_tokens):
    return gptq_quantize_model(tiny, calib_tokens, group_size=32, act_order=True,
                               progress=False)[0]


def test_gptq_files_and_round_trip(gptq_model, tmp_path):
    save_quantized(gptq_model, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == 32
    assert qc["desc_act"] is True and qc["sym"] is False and qc["checkpoint_format"] == "gptq"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
        p = "model.layers.0.mlp.down_proj"  # in 128, out 64
        assert st.get_tensor(p + ".qweight").shape == (16, 64)
        assert st.get_tensor(p + ".qweight").dtype == torch.int32
        assert st.get_tensor(p + ".qzeros").shape == (4, 8)
        assert st.get_tensor(p + ".scales").dtype == torch.float16
        assert st.get_tensor(p + ".g_idx").shape == (128,)
        assert p + ".weight" not in st.keys()
    loaded = load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[1].self_attn.q_proj, GPTQLinear)
    x = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(loaded(x), gptq_model(x), atol=1e-5, rtol=1e-5)


def test_awq_round_trip_fp16_checkpoint(tiny, calib_tokens, tmp_path):
    awq, _ = awq_quantize_model(tiny, calib_tokens, group_size=32, n_grid=4, progress=False)
    save_quantized(awq, tmp_path)  # default: non-quantized tensors in fp16
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": None}
    loaded = load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[0].mlp.gate_proj, AWQLinear)
    for name, t in awq.state_dict().items():  # packed tensors bit-exact, the rest fp16-rounded
        ref = t if t.dtype in (torch.int32, torch.float16) else t.half().float()
        assert torch.equal(loaded.state_dict()[name], ref), name


def test_rtn_model_saves_in_gptq_layout(tiny, tmp_path):
    save_quantized(quantize_model(tiny, "int4_rtn", group_size=64), tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is False and qc["group_size"] == 64


def _rewrite_config(path, **qc):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (path / "config.json").write_text(json.dumps(cfg))


def test_mismatched_quantization_config_is_a_clear_error(gptq_model, tmp_path):
    save_quantized(gptq_model, tmp_path)
    _rewrite_config(tmp_path, group_size=64)
    with pytest.raises(CheckpointMismatchError, match=r"group_size=64.*imply"):
        load_quantized(tmp_path)
    _rewrite_config(tmp_path, group_size=32, bits=8)
    with pytest.raises(CheckpointMismatchError, match="qweight has shape"):
        load_quantized(tmp_path)
    _rewrite_config(tmp_path, bits=4, checkpoint_format="gptq_v2")
    with pytest.raises(CheckpointMismatchError, match="gptq_v2"):
        load_quantized(tmp_path)
    _rewrite_config(tmp_path, checkpoint_format="gptq", quant_method="awq")
    with pytest.raises(CheckpointMismatchError, match="qweight has shape"):
        load_quantized(tmp_path)
    _rewrite_config(tmp_path, quant_method="bitnet")
    with pytest.raises(CheckpointMismatchError, match="bitnet"):
        load_quantized(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointMismatchError, match="no quantization_config"):
        load_quantized(tmp_path)


def test_missing_and_unexpected_tensors(gptq_model, tmp_path):
    save_quantized(gptq_model, tmp_path)
    f = str(tmp_path / "model.safetensors")
    with safe_open(f, "pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    bad = dict(tensors)
    del bad["model.layers.0.self_attn.k_proj.g_idx"]
    save_file(bad, f)
    with pytest.raises(CheckpointMismatchError, match="g_idx is missing"):
        load_quantized(tmp_path)
    bad = dict(tensors)
    bad["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(bad, f)
    with pytest.raises(CheckpointMismatchError, match="unexpected"):
        load_quantized(tmp_path)


def test_save_needs_a_packed_model(tiny, tmp_path):
    with pytest.raises(QuantizationError, match="no GPTQLinear/AWQLinear"):
        save_quantized(tiny, tmp_path)
    with pytest.raises(QuantizationError, match="no GPTQLinear/AWQLinear"):
        save_quantized(quantize_model(tiny, "nf4"), tmp_path)
