"""One spec per model family: each spec names its family's layers as transformers builds them, an unsupported
family or option is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, Gemma3TextConfig, GPT2Config

from pipetune.config import ConfigError
from pipetune.model.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_of, sliding_window_mask
from pipetune.model.shapes import one_layer_model

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_each_spec_names_the_linears_and_norms_of_its_decoder_layer(model_type: str) -> None:
    """The projections the spec splits for tp and LoRA are exactly the layer's linears; the inputs it groups and
    the norms sequence parallelism splits are among the layer's modules."""
    config = AutoConfig.for_model(model_type, **SMALL, num_hidden_layers=2)
    family = family_of(config)
    model = one_layer_model(config)
    layer = model.model.layers[0]
    linears = {name.rsplit(".", 1)[-1] for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    assert linears == set(family.projections)
    assert not set(family.column_wise) & set(family.row_wise)
    assert {name for group in family.shared_inputs for name in group} <= set(family.column_wise)
    children = {name.rsplit(".", 1)[-1] for name, _ in layer.named_modules()}
    assert set(family.block_norms) <= children
    for name in (*family.first_stage_only, *family.last_stage_only):
        model.get_submodule(name)  # raises for a module the family's model does not have


def test_an_unsupported_family_is_refused_listing_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match="model_type 'gpt2'; pipetune builds pipeline stages for") as error:
        family_of(GPT2Config(n_layer=2, n_embd=32, n_head=2), "model.name = 'x'")
    assert str(error.value).startswith("model.name = 'x' has")
    for family in FAMILIES:
        for model_type in family.model_types:
            assert model_type in str(error.value)


def test_a_gemma3_option_the_stage_does_not_compute_is_refused() -> None:
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=2, final_logit_softcapping=30.0)
    with pytest.raises(ConfigError, match="Gemma 3 model with final_logit_softcapping = 30.0"):
        family_of(config)
    config.final_logit_softcapping = None
    assert family_of(config).name == "Gemma 3"


@pytest.mark.parametrize("seq, window", [(8, 3), (6, 1), (5, 5)])
def test_sliding_window_mask_sees_the_last_window_positions(seq: int, window: int) -> None:
    mask = sliding_window_mask(seq, window, torch.device("cpu"))
    if seq <= window:
        assert mask is None  # plain causal attention: sdpa's is_causal, no mask
        return
    assert mask.shape == (1, 1, seq, seq)
    for query in range(seq):
        seen = [key for key in range(seq) if mask[0, 0, query, key]]
        assert seen == list(range(max(0, query - window + 1), query + 1))
