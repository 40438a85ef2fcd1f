"""Model FLOPs utilisation: the FLOPs of packed rows and the peak of known GPUs (trainer/flops.py)."""

import torch

from tandem.packing import pack
from tandem.trainer.flops import peak_flops, rows_flops
from tests.packing.samples import sample


def test_the_flops_of_a_packed_row_count_shared_tokens_once():
    # Two samples share [5, 6] (the trie branches one token before they differ, so 7 appears twice): 8 packed tokens;
    # each token attends to its depth + 1 keys; 4 positions predict trained tokens.
    row = pack([sample([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), sample([5, 6, 7, 10, 11], [0, 0, 0, 1, 1])])
    assert row.num_tokens == 8 and row.load == (1 + 2 + 3 + 4 + 5) + (3 + 4 + 5)
    params, hidden, vocab, layers = 1000, 8, 50, 2
    assert row.predict_index.unique().numel() == 4
    expected = 6 * params * 8 + 6 * hidden * vocab * 4 + 12 * layers * hidden * 27
    assert rows_flops([row], (params, hidden, vocab, layers)) == expected


def test_peaks_are_known_for_common_gpus_and_absent_on_cpu(monkeypatch):
    assert peak_flops(torch.device("cpu"), bf16=True) is None, "MFU is not logged on CPU"
    for name, bf16, fp32 in [
        ("NVIDIA H100 80GB HBM3", 989e12, 495e12),
        ("NVIDIA H100 PCIe", 756e12, 378e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 156e12),
        ("NVIDIA A10G", 70e12, 35e12),
        ("NVIDIA L40S", 362e12, 183e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert (peak_flops(torch.device("cuda"), True), peak_flops(torch.device("cuda"), False)) == (bf16, fp32), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peak_flops(torch.device("cuda"), True) is None
