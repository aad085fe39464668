"""scripts/bridge_lora_parity.py's comparison on the CPU, against stand-in adapters laid out as
Megatron-Bridge's (A = linear_in [r, in], B = linear_out [out, r], scale alpha/dim). Bridge itself is not
installed here: the stand-ins check that the comparison passes an identical adapter and names each kind
of difference."""
import math

import pytest
import torch

from tests_helpers import load_script

parity = load_script("scripts/bridge_lora_parity.py", "_bridge_lora_parity")
H, O, R, ALPHA = 64, 48, 8, 16


def _stand_in(init, scale=ALPHA / R, grad_factor=1.0):
    torch.manual_seed(0)
    weight = torch.randn(O, H)
    a = torch.nn.Parameter(torch.empty(R, H))
    init(a)
    b = torch.nn.Parameter(torch.zeros(O, R))

    def forward(x):
        delta = (x @ a.t()) @ b.t() * scale
        if grad_factor != 1.0:  # a gradient scaled wrongly, forward unchanged
            delta = delta * grad_factor + (delta * (1 - grad_factor)).detach()
        return x @ weight.t() + delta

    return forward, a, b, scale, weight


def _verdicts(checks):
    return {c.name: c.ok for c in checks}


def test_an_adapter_that_trains_like_peft_passes():
    kaiming = lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))  # PEFT's and Bridge's "kaiming"
    got = _verdicts(parity.compare(*_stand_in(kaiming), rank=R, alpha=ALPHA))
    assert all(got.values()), got


def test_xavier_a_init_is_named_as_an_init_difference():
    """Bridge's default A init (xavier_normal_) against PEFT's kaiming_uniform(a=sqrt(5)): at Kimi-K2's
    hidden size 7168 and rank 32 the ratio of std is sqrt(3*7168*2/7200) ~ 2.4; at this size ~1.9."""
    checks = parity.compare(*_stand_in(torch.nn.init.xavier_normal_), rank=R, alpha=ALPHA)
    got = _verdicts(checks)
    assert not got["init"] and got["scaling"] and got["grad_A"] and got["sgd_update"]
    assert math.sqrt(3 * 7168 * 2 / (7168 + 32)) == pytest.approx(2.44, abs=0.01)


@pytest.mark.parametrize("kw,fails", [({"scale": 1.0}, {"scaling", "forward", "grad_A", "grad_B", "sgd_update"}),
                                      ({"grad_factor": 0.5}, {"grad_A", "grad_B", "sgd_update"})])
def test_a_wrong_scale_or_gradient_is_named(kw, fails):
    kaiming = lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    got = _verdicts(parity.compare(*_stand_in(kaiming, **kw), rank=R, alpha=ALPHA))
    assert {k for k, ok in got.items() if not ok} == fails, got


def test_without_bridge_it_says_what_it_needs(capsys):
    pytest.importorskip("megatron.core")
    try:
        import megatron.bridge  # noqa: F401
        pytest.skip("megatron-bridge is installed: the script runs for real")
    except ImportError:
        pass
    assert parity.main(["--hidden", "64", "--out", "48", "--rank", "8"]) == 2
    assert "needs megatron-core and megatron-bridge" in capsys.readouterr().err
