"""Gated DeltaNet hybrids and vision-language checkpoints: a hybrid trains on tree rows (each branch from its parent's
recurrent state), a VLM trains its language model (text only, the vision tower frozen and never synced). Both train
exactly on policy through the embedded `tandem serve` in the model-family matrix (tests/families: Qwen3.5 hybrid,
Qwen2.5-VL)."""

import asyncio

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForImageTextToText, Qwen3_5Config

from tandem import AsyncGRPOConfig
from tandem.generation.client import ControlClient
from tandem.packing import TREE, pack
from tandem.packing.log_probs import row_log_probs
from tandem.runtime.weight_transfer import GlooPlane, TransferSync
from tandem.trainer.model import check_dataset, load_model
from tests.conftest import ServerThread, saved_with_tiny_tokenizer
from tests.packing.samples import sample


class RecordingPlane(GlooPlane):
    """The gloo plane, noting the name of every tensor it sends."""

    sent: list[str] = []

    def send(self, tensors, timeout_s):
        super().send(((self.sent.append(name), (name, tensor))[1] for name, tensor in tensors), timeout_s)


def test_a_vision_language_checkpoint_trains_its_language_model_and_syncs_only_that(vlm_path):
    _, model, layout = load_model(vlm_path, AsyncGRPOConfig(output_dir="unused"))
    assert layout == TREE, "its language model is pure attention: tree-packed"
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(name.startswith(("model.language_model.", "lm_head.")) for name in trained)
    assert not any(p.requires_grad for p in model.model.visual.parameters()), "vision tower and projector frozen"
    tower = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    server = ServerThread(vlm_path, weight_transfer_config='{"backend": "gloo"}')
    try:
        with asyncio.Runner() as run:
            control = ControlClient(server.url)
            sync = TransferSync(control, run, vlm_path, plane=RecordingPlane())
            sync.connect()
            sync.push(model, 1)
            run.run(control.close())
        served = dict(server.server.engine.model.named_parameters())
    finally:
        server.close()
    assert set(RecordingPlane.sent) == trained, "the sync sends exactly the trained weights, under the served names"
    assert all(torch.equal(served[name], p) for name, p in model.named_parameters() if name in trained)
    assert all(torch.equal(served[name], before) for name, before in tower.items()), "the server keeps its own tower"


def test_a_qwen3_5_vision_language_hybrid_trains_its_language_model_on_tree_rows(tmp_path):
    """Qwen3.5 ships as a VLM whose language model is a gated DeltaNet hybrid: both rules apply."""
    text = dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        eos_token_id=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [2, 3, 3],
            "partial_rotary_factor": 0.25,
        },
    )
    config = Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
        image_token_id=500,
    )
    folder = saved_with_tiny_tokenizer(AutoModelForImageTextToText.from_config(config), tmp_path / "qwen3_5")
    _, model, layout = load_model(folder, AsyncGRPOConfig(output_dir="unused"))
    assert layout == TREE and not any(p.requires_grad for p in model.model.visual.parameters())
    ids = list(range(3, 30))
    plain = (
        model(input_ids=torch.tensor([ids]))
        .logits[0, :-1]
        .log_softmax(-1)
        .gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    )
    tree = row_log_probs(model, pack([sample(ids), sample(ids[:20] + [9, 9], group=0)]), "exact").log_probs
    torch.testing.assert_close(tree[: len(ids) - 1], plain.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dataset, message",
    [
        (
            [{"prompt": [{"role": "user", "content": "hi"}], "images": ["a.png"]}],
            r"an 'images' column: tandem trains vision-language models on text only.*dataset.remove_columns\('images'\)",
        ),
        (
            [
                {
                    "prompt": [
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}
                    ]
                }
            ],
            "row 0: a 'user' message has an image content part: tandem trains vision-language models on text only.*"
            "Keep its text parts only",
        ),
    ],
)
def test_image_inputs_are_refused_with_the_fix(dataset, message):
    with pytest.raises(ValueError, match=message):
        check_dataset(Dataset.from_list(dataset))
