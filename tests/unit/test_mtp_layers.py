"""Multi-token-prediction layers passed through an export (engine/policy/mtp_layers.py), one process: a tiny
DeepSeek-V3 given one MTP layer under the hub's names (tests/helpers/mtp.py) has it copied byte for byte, streamed in
pieces, from a sharded or a single-file source (GLM-4.5's likewise); a source without them (the builtin tiny model, a stripped conversion,
no source) or with only some of them gives nothing, and the export's config then says 0. The sharded export through
Megatron at EP1 / EP2 / TP2 x EP2 / PP2: tests/distributed/test_family_layouts.py."""

import json
import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.models.tiny_model import build_tiny_model
from engine.policy import mtp_layers
from engine.policy.hf_checkpoint import export_config
from engine.policy.mtp_layers import MTP_SHARD, copy_mtp_layers, mtp_tensor_names
from tests.helpers.mtp import add_mtp_layer


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("ds") / "model", "deepseek_v3", seed=3)


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("glm") / "model", "glm4_moe", seed=3)


_ATTENTION = {"deepseek_v3": "self_attn.kv_a_proj_with_mqa.weight", "glm4_moe": "self_attn.q_proj.bias"}
"""A tensor of each family's attention that its MTP layer (a copy of a decoder layer) must carry."""


def _copy_of(tiny_deepseek, tmp_path, sharded: bool):
    """(source dir with an MTP layer, the MTP tensors written, the names copied, the export dir)."""
    import shutil

    source, out = tmp_path / "source", tmp_path / "out"
    shutil.copytree(tiny_deepseek, source)
    out.mkdir()
    extra = add_mtp_layer(source, sharded=sharded)
    return source, extra, copy_mtp_layers(source, AutoConfig.from_pretrained(source), out), out


@pytest.mark.parametrize("family,sharded", [("deepseek_v3", True), ("deepseek_v3", False), ("glm4_moe", True)],
                         ids=["deepseek_v3-sharded", "deepseek_v3-single_file", "glm4_moe-sharded"])
def test_mtp_layer_is_copied_byte_for_byte_in_pieces(request, tmp_path, monkeypatch, caplog, family, sharded):
    """Every model.layers.4.* tensor (the hub's MTP names: enorm, hnorm, eh_proj, shared_head, embed_tokens, the layer's
    attention (MLA; GLM-4.5's with its QKV bias) and MoE tensors) lands in the export's MTP shard with its dtype
    (bfloat16 next to the float32 expert bias) and its bytes, copied 1000 bytes at a time (pieces end inside tensors);
    the one warning names the source."""
    monkeypatch.setattr(mtp_layers, "_COPY_BYTES", 1000)
    caplog.set_level(logging.WARNING, logger="engine.policy.mtp_layers")
    model = request.getfixturevalue("tiny_deepseek" if family == "deepseek_v3" else "tiny_glm")
    source, extra, names, out = _copy_of(model, tmp_path, sharded)
    assert names == sorted(extra) and len(names) > 20
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.head.weight",
            f"model.layers.4.{_ATTENTION[family]}", "model.layers.4.mlp.experts.3.up_proj.weight",
            "model.layers.4.mlp.gate.e_score_correction_bias"} <= set(names)
    with safe_open(out / MTP_SHARD, framework="pt") as f:
        assert sorted(f.keys()) == names and f.metadata() == {"format": "pt"}
        for name in names:
            got = f.get_tensor(name)
            assert got.dtype == extra[name].dtype and torch.equal(got.view(torch.uint8), extra[name].view(torch.uint8))
    assert extra["model.layers.4.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert [r.getMessage() for r in caplog.records] == [caplog.records[0].getMessage()]
    assert f"not trained; exported unchanged from {source}" in caplog.records[0].getMessage()


def test_no_mtp_tensors_in_the_source_gives_none_and_the_export_config_says_0(tiny_deepseek, tmp_path, caplog):
    """The builtin tiny model (config 0: nothing, no warning); its config saying 1 without the tensors (a conversion
    that stripped them), no source, or a config asking for 2 layers where the source has 1: nothing copied, one
    warning each, and export_config sets 0 unless the layers were kept."""
    config = AutoConfig.from_pretrained(tiny_deepseek)
    assert config.num_nextn_predict_layers == 0 and copy_mtp_layers(tiny_deepseek, config, tmp_path) == []
    assert not caplog.records
    config.num_nextn_predict_layers = 1
    assert copy_mtp_layers(tiny_deepseek, config, tmp_path) == [] and copy_mtp_layers(None, config, tmp_path) == []
    assert len(caplog.records) == 2 and "lacks the multi-token-prediction tensors of some or all of model.layers.4-4.*" in caplog.records[0].getMessage()
    assert not (tmp_path / MTP_SHARD).exists()
    source, extra, names, _ = _copy_of(tiny_deepseek, tmp_path / "partial", sharded=True)
    config.num_nextn_predict_layers = 2
    assert names == sorted(extra) and mtp_tensor_names(source, config) == {}
    assert export_config(config, torch.bfloat16).num_nextn_predict_layers == 0
    assert export_config(config, torch.bfloat16, keep_mtp=True).num_nextn_predict_layers == 2
    assert json.loads((source / "config.json").read_text())["num_nextn_predict_layers"] == 1
