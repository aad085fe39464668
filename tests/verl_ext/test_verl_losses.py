"""moerl losses in verl's policy-loss registry: found by name, called the way verl calls them,
equal to the embedded functions and, where verl has the same formula, to verl's own losses."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from moerl.config import ConfigError, LossConfig, from_dict  # noqa: E402
from moerl.trainer.losses import policy_loss  # noqa: E402
from moerl.verl_ext import losses as vl  # noqa: E402

N, T = 6, 9


@pytest.fixture(autouse=True)
def _reset_config():
    vl.configure(None)
    yield
    vl.configure(None)


def actor(lo=0.2, hi=0.28, c=3.0, agg="token-mean", **kw):
    return ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2, clip_ratio=lo,
                       clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c, loss_agg_mode=agg, **kw)


def batch(seed=0, spread=0.4):
    """Tensors shaped as verl's ppo_loss passes them: [bs, response_length], bool response mask."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(N, T, generator=g) * 3
    old = rollout + spread * torch.randn(N, T, generator=g)
    logp = old + 0.2 * torch.randn(N, T, generator=g)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(N, 1, generator=g).expand(N, T).contiguous()
    return logp, old, rollout, adv, mask


def verl_weights(old, rollout, mask, threshold, level="token"):
    """The rollout_is_weights verl's driver would put in the batch."""
    proto, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.float(), rollout_is=level,
        rollout_is_threshold=threshold)
    assert torch.equal(new_mask.bool(), mask)
    return proto.batch["rollout_is_weights"]


def call(name, logp, old, adv, mask, config, weights=None, agg="token-mean"):
    """Exactly the keyword call of verl/workers/utils/losses.py::ppo_loss."""
    fn = get_policy_loss_fn(name)
    return fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
              config=config, rollout_is_weights=weights)


def test_registered_names_resolve_to_moerl_functions():
    for name in vl.VERL_NAMES:
        fn = get_policy_loss_fn(name)
        assert fn is vl.REGISTERED[name] and fn.__name__ == name
    with pytest.raises(ValueError, match="moerl_tis"):  # verl lists them among the supported modes
        get_policy_loss_fn("moerl_nope")


CASES = [
    ("ppo_clip", {}),
    ("ppo_clip", {"dual_clip_c": 3.0}),
    ("tis", {"tis_cap": 2.0}),
    ("tis", {"is_level": "sequence", "tis_cap": 3.0}),
    ("mis", {"is_level": "token", "mis_lower": 0.7, "mis_upper": 1.4}),
    ("mis", {"is_level": "sequence", "mis_lower": 0.5, "mis_upper": 2.0}),
    ("mis", {"is_level": "geometric", "mis_lower": 0.9, "mis_upper": 1.1, "mis_veto": 0.3}),
    ("icepop", {"icepop_alpha": 0.8, "icepop_beta": 1.3}),
    ("gspo", {"gspo_eps_low": 0.05, "gspo_eps_high": 0.05}),
    ("bypass", {}),
]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("variant,knobs", CASES)
def test_verl_call_matches_embedded(variant, knobs, agg):
    logp, old, rollout, adv, mask = batch()
    cfg = LossConfig(variant=variant, aggregation=vl.AGG_FROM_VERL[agg], **knobs)
    vl.configure(cfg)
    lo, hi = (cfg.gspo_eps_low, cfg.gspo_eps_high) if variant == "gspo" else (cfg.eps_low, cfg.eps_high)
    weights = verl_weights(old, rollout, mask, vl.NO_TRUNCATION)
    lp_verl = logp.clone().requires_grad_(True)
    loss_v, metrics_v = call(f"moerl_{variant}", lp_verl, old, adv, mask, actor(lo, hi, agg=agg), weights, agg)
    lp_ours = logp.clone().requires_grad_(True)
    loss_o, metrics_o = policy_loss(lp_ours, old, rollout, adv, mask, cfg)
    loss_v.backward()
    loss_o.backward()
    assert float(loss_v.detach()) == pytest.approx(float(loss_o.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp_verl.grad, lp_ours.grad, rtol=1e-4, atol=1e-7)
    for key in ("is/mean", "mask/token_frac", "effective/token_frac", "clip/frac"):
        assert metrics_v[f"moerl/{key}"] == pytest.approx(metrics_o[key], rel=1e-4, abs=1e-7)
    assert "actor/pg_clipfrac" in metrics_v


def test_ppo_clip_equals_verl_vanilla():
    logp, old, _, adv, mask = batch(1)
    vl.configure(LossConfig(variant="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip_c=3.0))
    ours, m = call("moerl_ppo_clip", logp, old, adv, mask, actor(0.2, 0.28, 3.0))
    theirs, tm = call("vanilla", logp, old, adv, mask, actor(0.2, 0.28, 3.0))
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(tm["actor/pg_clipfrac"])
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(tm["actor/pg_clipfrac_lower"])
    assert m["actor/ppo_kl"] == pytest.approx(tm["actor/ppo_kl"], rel=1e-5)


@pytest.mark.parametrize("level,threshold", [("token", 2.0), ("sequence", 3.0)])
def test_tis_equals_verl_vanilla_with_verl_tis_weights(level, threshold):
    logp, old, rollout, adv, mask = batch(2, spread=0.8)
    vl.configure(LossConfig(variant="tis", is_level=level, tis_cap=threshold, dual_clip_c=3.0))
    raw = verl_weights(old, rollout, mask, vl.NO_TRUNCATION)  # moerl always gets raw token weights
    ours, m = call("moerl_tis", logp, old, adv, mask, actor(), raw)
    assert 0 < m["moerl/is/truncated_frac"] < 1  # the cap binds on some tokens, not all
    truncated = verl_weights(old, rollout, mask, threshold, level)
    theirs, _ = call("vanilla", logp, old, adv, mask, actor(), truncated)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_icepop_equals_verl_vanilla_with_verl_icepop_weights():
    logp, old, rollout, adv, mask = batch(3)
    vl.configure(LossConfig(variant="icepop", icepop_alpha=0.7, icepop_beta=1.5, dual_clip_c=3.0))
    ours, m = call("moerl_icepop", logp, old, adv, mask, actor(), verl_weights(old, rollout, mask, vl.NO_TRUNCATION))
    theirs, _ = call("vanilla", logp, old, adv, mask, actor(), verl_weights(old, rollout, mask, "0.7_1.5"))
    assert m["moerl/mask/token_frac"] > 0  # the band is tight enough to mask something
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_gspo_equals_verl_gspo():
    logp, old, _, adv, mask = batch(4, spread=0.0)
    vl.configure(LossConfig(variant="gspo", gspo_eps_low=0.05, gspo_eps_high=0.05))
    for agg in ("token-mean", "seq-mean-token-mean"):
        ours, _ = call("moerl_gspo", logp, old, adv, mask, actor(0.05, 0.05, agg=agg), agg=agg)
        theirs, _ = call("gspo", logp, old, adv, mask, actor(0.05, 0.05, agg=agg), agg=agg)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


def test_bypass_equals_verl_bypass_mode():
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    logp, _, rollout, adv, mask = batch(5)
    vl.configure(LossConfig(variant="bypass", dual_clip_c=3.0))
    pl = PolicyLossConfig(loss_mode="bypass_mode",
                          rollout_correction=RolloutCorrectionConfig(rollout_is=None, rollout_rs=None, bypass_mode=True))
    cfg = actor(policy_loss=pl)
    ours, _ = call("moerl_bypass", logp, rollout, adv, mask, cfg)  # verl bypass: old_log_prob = rollout
    theirs, _ = call("bypass_mode", logp, rollout, adv, mask, cfg)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_global_batch_info_is_verls_normaliser():
    logp, old, rollout, adv, mask = batch(6)
    vl.configure(LossConfig(variant="tis"))
    w = verl_weights(old, rollout, mask, vl.NO_TRUNCATION)
    cfg = actor()
    local, _ = call("moerl_tis", logp, old, adv, mask, cfg, w)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=int(mask.sum()) * 4, global_batch_size=None)
    scaled, _ = call("moerl_tis", logp, old, adv, mask, cfg, w)
    assert float(scaled) == pytest.approx(float(local) * 2 / 4, rel=1e-6)


def test_missing_or_masked_weights_are_refused():
    logp, old, rollout, adv, mask = batch(7)
    vl.configure(LossConfig(variant="tis"))
    with pytest.raises(ValueError, match="rollout_is=token"):
        call("moerl_tis", logp, old, adv, mask, actor(), None)
    w = verl_weights(old, rollout, mask, "0.9_1.1")  # verl IcePop already zeroed tokens
    with pytest.raises(ValueError, match=r"zero or non-finite.*sample\(s\)"):
        call("moerl_tis", logp, old, adv, mask, actor(), w)
    # ppo_clip and gspo need no rollout logprobs
    vl.configure(LossConfig(variant="ppo_clip"))
    call("moerl_ppo_clip", logp, old, adv, mask, actor(), None)


def test_clip_range_disagreement_is_an_error():
    logp, old, rollout, adv, mask = batch(8)
    vl.configure(LossConfig(variant="ppo_clip", eps_low=0.2, eps_high=0.28))
    with pytest.raises(ValueError, match=r"actor.clip_ratio_high=0.2 .*loss.eps_high=0.28"):
        call("moerl_ppo_clip", logp, old, adv, mask, actor(0.2, 0.2))
    with pytest.raises(ValueError, match=r"loss_agg_mode='token-sum'"):
        call("moerl_ppo_clip", logp, old, adv, mask, actor(), agg="token-sum")


def test_env_config(monkeypatch):
    cfg = LossConfig(variant="mis", is_level="geometric", mis_lower=0.97, mis_upper=1.03)
    monkeypatch.setenv(vl.ENV_CONFIG, json.dumps(dataclasses.asdict(cfg)))
    assert vl.moerl_loss_config() == cfg
    monkeypatch.setenv(vl.ENV_CONFIG, '{"variant": "mis", "mis_lower": 2.0, "mis_upper": 1.0}')
    with pytest.raises(ConfigError, match=r"MOERL_LOSS_CONFIG.*loss.mis_lower=2.0 must be < loss.mis_upper=1.0"):
        vl.moerl_loss_config()
    monkeypatch.setenv(vl.ENV_CONFIG, '{"variant": "tis", "tis_cpa": 2}')
    with pytest.raises(ConfigError, match=r"loss.tis_cpa.*tis_cap"):
        vl.moerl_loss_config()
    monkeypatch.setenv(vl.ENV_CONFIG, "variant=tis")
    with pytest.raises(ConfigError, match="not valid JSON"):
        vl.moerl_loss_config()


@pytest.mark.parametrize("variant", ["tis", "gspo", "bypass"])
def test_overrides_compose_into_verl_config(variant):
    """verl_overrides go through Hydra into verl's own ppo_trainer config unchanged."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    import verl

    cfg = LossConfig(variant=variant, gspo_eps_low=3e-4, gspo_eps_high=4e-4,
                     aggregation="seq_mean_token_mean" if variant == "gspo" else "token_mean")
    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        c = compose(config_name="ppo_trainer", overrides=vl.verl_overrides(cfg))
    a = c.actor_rollout_ref.actor
    assert a.policy_loss.loss_mode == f"moerl_{variant}"
    lo, hi = (3e-4, 4e-4) if variant == "gspo" else (0.2, 0.28)
    assert a.clip_ratio_low == pytest.approx(lo) and a.clip_ratio_high == pytest.approx(hi)
    assert a.loss_agg_mode == vl.AGG_TO_VERL[cfg.aggregation]
    env = c.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.VERL_USE_EXTERNAL_MODULES == "moerl.verl_ext.losses"
    assert from_dict(LossConfig, json.loads(env[vl.ENV_CONFIG]), "loss") == cfg
    rc = c.algorithm.rollout_correction
    if variant == "tis":
        assert rc.rollout_is == "token" and float(rc.rollout_is_threshold) >= 4.9e8 and rc.rollout_rs is None
        assert c.actor_rollout_ref.rollout.calculate_log_probs is True
    if variant == "bypass":
        assert rc.bypass_mode is True and rc.loss_type == "ppo_clip"


def test_verl_external_modules_env_registers_in_a_fresh_process():
    """What a Ray worker does: `import verl` with VERL_USE_EXTERNAL_MODULES set."""
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="moerl.verl_ext.losses")
    code = ("import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
            "print(sorted(k for k in R if k.startswith('moerl_')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(sorted(vl.VERL_NAMES))
