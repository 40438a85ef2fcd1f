"""The table of vLLM's request fields (serve/fields.py) and the request models agree: every field a model declares
has its line in the table, every field the table says acts is declared, and a refused field's default is accepted."""

import pytest

from tandem.serve import fields, protocol

MODELS = {
    "/v1/completions": protocol.CompletionRequest,
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    "/inference/v1/generate": protocol.GenerateRequest,
    "/inference/v1/generate sampling_params": protocol.GenerateSampling,
    "/tokenize": protocol.TokenizeRequest,
    "/detokenize": protocol.DetokenizeRequest,
    "/v1/load_lora_adapter": protocol.LoadLoRARequest,
    "/v1/unload_lora_adapter": protocol.UnloadLoRARequest,
}


@pytest.mark.parametrize("route", list(MODELS))
def test_each_route_table_covers_its_model(route):
    table, declared = fields.ROUTES[route], MODELS[route].model_fields
    assert not set(declared) - set(table), (
        f"{route}: fields read but not in fields.py's table: {set(declared) - set(table)}"
    )
    acting = {name for name, rule in table.items() if rule.status == fields.ACTS}
    assert not acting - set(declared), f"{route}: said to act but never read: {acting - set(declared)}"
    for name, rule in table.items():
        if rule.status == fields.REFUSED and name in declared:
            assert declared[name].default in rule.accepted, f"{route}: {name}'s default would be refused"
        assert rule.status == fields.ACTS or rule.note, f"{route}: {name} needs its reason"


def test_a_refused_value_is_a_400_naming_the_field_and_its_default_passes():
    protocol.refuse({"use_beam_search": False, "suffix": None}, fields.COMPLETIONS)
    with pytest.raises(protocol.ApiError) as refused:
        protocol.refuse({"use_beam_search": True}, fields.COMPLETIONS)
    assert refused.value.status == 400 and refused.value.param == "use_beam_search"
    assert "beam search is not implemented by tandem serve" in refused.value.message
