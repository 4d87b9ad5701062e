"""Features that address MLP weights by the dense names refuse a mixture-of-experts model with
MoEUnsupportedError naming the feature and the architecture, instead of a wrong answer or an
AttributeError; fused projections fuse attention and leave the experts alone."""

import pytest
import torch

from labkit.errors import MoEUnsupportedError
from labkit.model.testing import tiny_model

MOE = dict(architecture="Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe():
    return tiny_model(0, **MOE)


def _refused(feature: str):
    arch = r"Qwen2MoeForCausalLM has sparse MoE MLPs in layers \[0\]"
    return pytest.raises(MoEUnsupportedError, match=rf"{feature}.*{arch}")


def test_tensor_parallelism(moe, tmp_path):
    from labkit.engine.llm import LLM
    from labkit.parallel.plan import make_plan

    with _refused("tensor parallelism"):
        make_plan(moe.config, 2, 0)
    with _refused("tensor parallelism"):  # before any worker process is started
        LLM(moe, tensor_parallel_size=2, block_size=4)
    make_plan(tiny_model(0).config, 2, 0)  # the dense control still plans


def test_weight_quantization(moe):
    from labkit.quant.awq import awq_quantize_model
    from labkit.quant.memory import estimate_memory
    from labkit.quant.model import gptq_quantize_model, quantize_model

    calib = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    for fmt in ("int8", "nf4"):
        with _refused(f"weight quantization \\(quantize_model '{fmt}'\\)"):
            quantize_model(moe, fmt)
    with _refused(r"weight quantization \(gptq_quantize_model\)"):
        gptq_quantize_model(moe, calib, progress=False)
    with _refused(r"weight quantization \(awq_quantize_model\)"):
        awq_quantize_model(moe, calib, progress=False)
    with _refused("the quantization memory estimate"):
        estimate_memory(moe.config, "int8")
    quantize_model(tiny_model(0), "int8")  # dense control


def test_gguf_export(moe, tmp_path):
    from labkit.quant.gguf_export import export_gguf

    with _refused("GGUF export"):
        export_gguf(moe, tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_lean_draft_and_eagle(moe):
    from labkit.spec.eagle import EagleDraft
    from labkit.spec.lean_draft import LeanDraft, lean_draft

    assert lean_draft(moe) is None  # a draft it does not cover runs through the module
    with _refused(r"the lean draft \(LeanDraft\)"):
        LeanDraft(moe)
    with _refused("an EAGLE head"):
        EagleDraft(moe)
    assert lean_draft(tiny_model(0)) is not None  # dense control
    # Qwen3's q/k norms are not in the lean forward either, MoE layers or not
    qwen3 = tiny_model(0, architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4,
                       num_experts_per_tok=2, mlp_only_layers=[0, 1])
    assert qwen3.config.moe_layers == [] and lean_draft(qwen3) is None


def test_pruning_and_layer_dropping(moe):
    from labkit.compress.distill import drop_layers
    from labkit.compress.prune import importance, prune_masked, prune_structured, reconstruct

    calib = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with _refused(r"pruning \(importance\)"):
        importance(moe, calib)
    with _refused(r"pruning \(prune_structured\)"):
        prune_structured(moe, {}, 0.25, 0.25)
    with _refused(r"pruning \(prune_masked\)"):
        prune_masked(moe, "2:4")
    with _refused(r"pruning \(reconstruct\)"):
        reconstruct(moe, moe, calib)
    with _refused(r"layer dropping \(drop_layers\)"):
        drop_layers(moe, [0])


QWEN3 = dict(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])


@pytest.mark.parametrize("kw", [MOE, QWEN3], ids=["qwen2_moe", "qwen3_moe-qk-norm"])
def test_fused_projections_fuse_attention_and_skip_the_experts(kw):
    from labkit.model.fuse import fuse_projections

    model = tiny_model(0, **kw)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    with torch.no_grad():
        before = model(ids)
        # q|k|v in both layers, gate|up in the one dense layer (1); the MoE MLP is left alone
        assert fuse_projections(model) == 3
        assert not hasattr(model.model.layers[0].mlp, "gate_up_proj")
        assert hasattr(model.model.layers[1].mlp, "gate_up_proj")
        assert model.model.layers[0].mlp.experts.gate_up_proj is experts
        torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)
