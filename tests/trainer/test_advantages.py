import torch

from moerl.trainer.advantages import group_advantages


def test_group_normalised_and_zero_for_uniform_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, group)
    assert torch.allclose(adv[:4], torch.tensor([3.0, -1.0, -1.0, -1.0]) / 3 ** 0.5, atol=1e-4)
    assert (adv[4:] == 0).all()
    assert abs(float(adv[:4].sum())) < 1e-5
    dr = group_advantages(rewards, group, scale_by_std=False)
    assert torch.allclose(dr[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
