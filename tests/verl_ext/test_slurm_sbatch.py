"""scripts/slurm_verl.sbatch's control flow on CPU: stand-in ``srun``, ``scontrol`` and ``ray``
executables on PATH record what the script asks of the cluster. The real script and the real
scripts/wait_for_ray.py run; only the cluster is pretend."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = {"nodeA": "10.0.0.1", "nodeB": "10.0.0.2"}

SRUN = r'''#!/bin/bash
# stand-in srun: skip options, log the command, act for the few commands the script needs
node=""
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in -w) node="$2"; shift 2;; *) shift;; esac
done
echo "srun[$node] $*" >> "$FAKE_LOG"
case "$1" in
    hostname) FAKE_NODE="$node" exec "$@";;
    ray) FAKE_NODE_IP=$(tr ',' '\n' <<< "$FAKE_IPS" | awk -F= -v n="$node" '$1==n {print $2}') exec "$@";;
    *) exit 0;;
esac
'''

RAY = r'''#!/bin/bash
# stand-in ray: "start" registers this node (unless it is in FAKE_DEAD); "list nodes" prints them
echo "ray $*" >> "$FAKE_LOG"
if [[ "$1" == start ]]; then
    [[ ",$FAKE_DEAD," == *",$FAKE_NODE_IP,"* ]] && exit 0
    echo "{\"node_ip\": \"$FAKE_NODE_IP\", \"state\": \"ALIVE\", \"resources_total\": {\"GPU\": 8}}" >> "$FAKE_STATE"
    exit 0
fi
if [[ "$1" == list ]]; then
    [[ -f "$FAKE_STATE" ]] || exit 1   # head not up yet
    echo "["; paste -sd, "$FAKE_STATE"; echo "]"
fi
'''


HOSTNAME = r'''#!/bin/bash
# stand-in hostname, run on node $FAKE_NODE: -I lists every address, --ip-address what the name resolves to
ip=$(tr ',' '\n' <<< "$FAKE_IPS" | awk -F= -v n="$FAKE_NODE" '$1==n {print $2}')
case "${FAKE_HOSTNAME:-plain}:$1" in
    plain:*) echo "$ip";;
    ipv6_first:-I) echo "fe80::1 2001:db8::5 $ip";;            # IPv6 listed first
    ipv6_first:--ip-address) echo "2001:db8::5 $ip";;
    loopback:-I) echo "";;                                       # -I unsupported/empty here
    loopback:--ip-address) echo "127.0.1.1 $ip";;                # Debian's /etc/hosts line first
    only_loopback:*) echo "127.0.1.1";;
esac
'''


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path: Path, fakes: dict[str, str] | None = None, **env_extra) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (fakes or {}).items():
        _exe(bin_dir / name, text)
    _exe(bin_dir / "srun", SRUN)
    _exe(bin_dir / "ray", RAY)
    _exe(bin_dir / "hostname", HOSTNAME)
    _exe(bin_dir / "scontrol", "#!/bin/bash\nprintf '%s\\n' " + " ".join(NODES) + "\n")
    (bin_dir / "python3").symlink_to(sys.executable)
    venv = tmp_path / "env" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    log = tmp_path / "cluster.log"
    env = {**os.environ, "MOERL_ENV": str(tmp_path / "env"), "SLURM_JOB_NODELIST": "node[A-B]",
           "SLURM_JOB_ID": "4242", "SLURM_GPUS_PER_NODE": "8", "MOERL_RAY_WAIT_S": "2", "MOERL_RAY_POLL_S": "0.2",
           "FAKE_LOG": str(log), "FAKE_STATE": str(tmp_path / "ray_nodes"),
           "FAKE_IPS": ",".join(f"{k}={v}" for k, v in NODES.items()), "FAKE_DEAD": "", **env_extra}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_verl.sbatch"),
                           "experiments/03_qwen3_30b_a3b_lora_mitigations", "--arm", "r3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc, log.read_text() if log.exists() else ""


def test_waits_for_every_gpu_then_launches_with_a_short_node_local_temp_dir(tmp_path):
    proc, log = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    starts = [line for line in log.splitlines() if line.startswith("ray start")]
    assert len(starts) == 2 and all("--temp-dir=/tmp/ray_4242" in s for s in starts)
    assert "16 GPUs on 2 node(s)" in proc.stdout
    launch = [i for i, line in enumerate(log.splitlines()) if "moerl.verl_ext.launch" in line]
    assert len(launch) == 1 and "--arm r3" in log.splitlines()[launch[0]]
    assert "sleep" not in (REPO / "scripts" / "slurm_verl.sbatch").read_text()


def test_a_node_that_never_joins_is_named_and_verl_never_starts(tmp_path):
    proc, log = _run(tmp_path, FAKE_DEAD="10.0.0.2")
    assert proc.returncode != 0
    assert "nodeB (10.0.0.2)" in proc.stderr and "need 16" in proc.stderr
    assert "nodeA (10.0.0.1)" not in proc.stderr
    assert "moerl.verl_ext.launch" not in log


@pytest.mark.parametrize("tmpdir,why", [("/tmp/" + "x" * 60, "107-byte"), ])
def test_ray_temp_dir_that_is_too_long_is_refused_before_ray_starts(tmp_path, tmpdir, why):
    proc, log = _run(tmp_path, MOERL_RAY_TMPDIR=tmpdir)
    assert proc.returncode == 1 and why in proc.stderr
    assert "ray start" not in log


def test_ray_temp_dir_on_a_shared_filesystem_is_refused(tmp_path):
    proc, log = _run(tmp_path, fakes={"stat": "#!/bin/bash\necho lustre\n"})  # stat -f -c %T says Lustre
    assert proc.returncode == 1 and "shared filesystem" in proc.stderr
    assert "ray start" not in log


@pytest.mark.parametrize("style", ["plain", "ipv6_first", "loopback"])
def test_ray_gets_each_nodes_ipv4_address_and_the_cpus_slurm_gave(tmp_path, style):
    """An IPv6 address or 127.0.1.1 listed first is skipped (as verl's slurm example skips IPv6);
    every ray start gets --num-cpus from SLURM_CPUS_PER_TASK."""
    proc, log = _run(tmp_path, FAKE_HOSTNAME=style, SLURM_CPUS_PER_TASK="96")
    assert proc.returncode == 0, proc.stderr
    starts = [line for line in log.splitlines() if line.startswith("ray start")]
    assert "--head --node-ip-address=10.0.0.1" in starts[0] and "--node-ip-address=10.0.0.2" in starts[1]
    assert all("--address=10.0.0.1:6379" in s for s in starts[1:])
    assert all("--num-cpus=96" in s for s in starts)


def test_a_node_with_only_a_loopback_address_is_named_before_ray_starts(tmp_path):
    proc, log = _run(tmp_path, FAKE_HOSTNAME="only_loopback")
    assert proc.returncode != 0 and "node nodeA has no IPv4 address outside 127.0.0.0/8" in proc.stderr
    assert "ray start" not in log


def test_the_container_binds_model_data_checkpoint_and_log_dirs(tmp_path):
    """Apptainer shows only $PWD by default: every directory the run reads or writes is bound at its own path."""
    lustre = tmp_path.parent / f"{tmp_path.name}_lustre"  # outside $PWD, which is bound anyway
    dirs = {v: lustre / v.lower() for v in ("MOERL_DATA_DIR", "MOERL_CHECKPOINT_DIR", "MOERL_LOG_DIR",
                                                           "QWEN3_30B_A3B_PATH")}
    for d in dirs.values():
        d.mkdir(parents=True)
    proc, log = _run(tmp_path, MOERL_CONTAINER=str(tmp_path / "moerl.sif"), MOERL_BINDS="/dev/infiniband",
                     PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",  # no venv to activate in a container
                     **{k: str(v) for k, v in dirs.items()})
    bound = [line for line in log.splitlines() if "apptainer exec --nv --bind" in line]
    assert bound, proc.stderr + log
    binds = bound[0].split("--bind ", 1)[1].split()[0].split(",")
    assert set(binds) >= {str(tmp_path.resolve()), "/dev/infiniband", *(str(d.resolve()) for d in dirs.values())}


def test_a_bind_that_does_not_exist_stops_the_job_before_any_node_is_touched(tmp_path):
    proc, log = _run(tmp_path, MOERL_CONTAINER=str(tmp_path / "moerl.sif"), KIMI_K2_PATH="/lustre/nowhere/kimi")
    assert proc.returncode == 1
    assert "KIMI_K2_PATH=/lustre/nowhere/kimi does not exist" in proc.stderr
    assert "srun" not in log
