"""Which trainers let the writer thread copy a background commit's state (checkpoint/writer.py,
`defer_copies`): only those whose saved state is all parameters, which change in optimizer steps only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainpod.train.trainer import Trainer


class WithRotaryCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)  # not saved


def only_parameters(model: torch.nn.Module) -> bool:
    trainer = SimpleNamespace(model=model, _only_parameters=None)
    return Trainer._state_changes_only_in_optimizer_steps(trainer)


def test_a_model_whose_saved_state_is_all_parameters_defers_its_copies():
    assert only_parameters(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    assert only_parameters(WithRotaryCache())


def test_a_model_with_a_saved_buffer_a_forward_updates_copies_at_the_commit():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = model[1].running_mean.clone()
    model.train()(torch.randn(8, 4))
    assert not torch.equal(model[1].running_mean, before), "a forward changes the saved statistics"
    assert not only_parameters(model)


def test_tied_weights_count_as_parameters():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert only_parameters(model)
