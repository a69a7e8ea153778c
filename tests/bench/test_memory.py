"""pipeline/bench/memory.py (and the plot's note): the memory-bound limit of decoding."""

from __future__ import annotations


def test_memory_bound_counts_tied_weights_once_and_divides_bandwidth_by_them():
    import torch

    from pipeline.bench.memory import MemoryBound, read_bandwidth, weight_bytes
    from pipeline.bench.plot import memory_bound_note

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied: one tensor, read once per step
    model.norm = torch.nn.LayerNorm(4).to(torch.float16)
    assert weight_bytes(model) == 10 * 4 * 4 + 2 * 4 * 2
    assert read_bandwidth(probe_bytes=8 << 20, repeats=1) > 0
    bound = MemoryBound(bandwidth_gbs=20.0, weight_bytes=500_000_000, tok_s=40.0)
    assert bound.to_dict() == {"memory_bandwidth_gbs": 20.0, "target_weight_bytes": 500_000_000,
                               "memory_bound_tok_s": 40.0}
    records = [{"method": "target", "prompt_set": "code", "tokens_per_s": 10.0, "fraction_of_memory_bound": 0.25},
               {"method": "ngram", "prompt_set": "code", "tokens_per_s": 20.0, "fraction_of_memory_bound": 0.5}]
    assert memory_bound_note(records) == "\nmemory-bound limit 40 tok/s; target only reached code 0.25 of it"
    assert memory_bound_note([{**records[0], "fraction_of_memory_bound": None}]) == ""


def test_int8_weights_count_at_their_size_and_bandwidth_follows_target_forwards():
    import torch

    from pipeline.bench.memory import MemoryBound, precision, weight_bytes
    from pipeline.quantize import quantize_model

    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    assert precision(model) == "bf16" and weight_bytes(model) == 64 * 32 * 2
    quantize_model(model, "int8_weight_only")
    assert precision(model) == "int8/bf16"
    assert weight_bytes(model) == 64 * 32 + 32 * 2  # int8 matrix + one bf16 scale per output channel
    assert precision(torch.nn.Linear(2, 2)) == "f32"
    bound = MemoryBound(bandwidth_gbs=20.0, weight_bytes=100_000_000, tok_s=200.0)
    assert bound.achieved_gbs(50.0, 1.0) == 5.0  # target-only: one forward per token
    assert bound.achieved_gbs(50.0, 2.5) == 2.0  # speculative: one forward per 2.5 tokens
    assert bound.achieved_gbs(50.0, None) == 5.0
