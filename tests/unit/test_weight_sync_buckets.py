"""Bucket boundaries of the weight sync fall between decoder layers only (vLLM reloads layer by layer)."""

from engine.rollout.colocated_sync import _layer_of


def test_layer_of_groups_every_tensor_of_a_decoder_layer():
    assert _layer_of("model.layers.3.self_attn.q_proj.weight") == _layer_of("model.layers.3.mlp.up_proj.weight")
    assert _layer_of("model.layers.3.mlp.up_proj.weight") != _layer_of("model.layers.4.mlp.up_proj.weight")
    assert _layer_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    # Nemotron-H's checkpoint names: backbone.layers.<i> (a split layer went uninitialised in vLLM's reload)
    assert _layer_of("backbone.layers.1.mixer.q_proj.weight") == _layer_of("backbone.layers.1.mixer.o_proj.weight")
    assert _layer_of("backbone.layers.1.mixer.q_proj.weight") != _layer_of("backbone.layers.2.mixer.up_proj.weight")
