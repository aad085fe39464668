"""The expert-bias side log on a stand-in model (no megatron-core): rows, verdicts, and the refit
side log installing it."""
import json

import torch

from moerl.verl_ext import expert_bias_log as ebl
from moerl.verl_ext.first_steps import RunReadError


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4))


def test_rows_measure_drift_from_the_first_calls_bias(tmp_path):
    model = torch.nn.Sequential(Router(), Router())
    log = tmp_path / "r.expert_bias.jsonl"

    def moving(chunks, step=1e-3):
        for b in ebl.router_biases(chunks):
            b += step

    wrapped = ebl.wrap(moving, log)
    wrapped([model])
    wrapped([model])
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["call"] for r in rows] == [1, 2] and rows[0]["routers"] == 2
    assert abs(rows[1]["max_abs_drift"] - 2e-3) < 1e-9
    v = ebl.check(log)
    assert not v.ok and "by gradient step 1" in v.detail


def test_a_frozen_bias_passes_and_a_missing_log_is_one_line(tmp_path):
    log = tmp_path / "r.expert_bias.jsonl"
    ebl.wrap(lambda chunks: None, log)([torch.nn.Sequential(Router())])
    assert ebl.check(log).ok
    try:
        ebl.check(tmp_path / "none.jsonl")
    except RunReadError as err:
        assert "no expert-bias side log" in str(err)
    else:
        raise AssertionError("a missing log must be refused")


def test_beside_the_refit_log():
    assert ebl.beside("/logs/04_rung1_seed0.refit.jsonl").name == "04_rung1_seed0.expert_bias.jsonl"


def test_install_waits_for_megatron_core_to_be_imported(tmp_path):
    """A process that imports verl (and so this hook) but never megatron-core does not load it; one that
    does gets the wrapper as the package is imported. Run in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from moerl.verl_ext import expert_bias_log as e\n"
        f"assert e.install({str(tmp_path / 'x.expert_bias.jsonl')!r})\n"
        "assert 'megatron.core' not in sys.modules\n"
        "import megatron.core.distributed as d\n"
        "assert d.finalize_model_grads.moerl_wrapped.__name__ == 'finalize_model_grads'\n"
        "from megatron.core.distributed import finalize_model_grads as f\n"
        "assert f is d.finalize_model_grads\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
