"""scripts/cuda_connections.sh, which run.sh and both sbatch scripts source: CUDA_DEVICE_MAX_CONNECTIONS
set to 1 where Megatron wants it (TP) and never 1 under Megatron-FSDP or FSDP2, which assert against it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _connections(config: Path, *args: str, before: str | None = None) -> str:
    env_line = "unset CUDA_DEVICE_MAX_CONNECTIONS" if before is None else f"export CUDA_DEVICE_MAX_CONNECTIONS={before}"
    script = (f'{env_line}; source "{REPO}/scripts/cuda_connections.sh"; set_cuda_connections "$@"; '
              'echo "${CUDA_DEVICE_MAX_CONNECTIONS-<unset>}"')
    out = subprocess.run(["bash", "-c", script, "bash", str(config), *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("config, args, before, want", [
    ("configs/tiny-cpu.yaml", (), None, "1"),
    ("configs/tiny-cpu.yaml", (), "4", "4"),  # the user's own value is kept
    ("configs/tiny-cpu-fsdp.yaml", (), None, "<unset>"),
    ("configs/tiny-cpu-fsdp.yaml", (), "1", "<unset>"),  # a 1 from the environment would be refused
    ("configs/tiny-cpu.yaml", ("--use-torch-fsdp2",), "1", "<unset>"),
    ("configs/tiny-cpu.yaml", ("--use-megatron-fsdp", "--lr", "1e-3"), None, "<unset>"),
])
def test_connections_follow_the_wrapper(config, args, before, want):
    assert (REPO / config).is_file()
    assert _connections(REPO / config, *args, before=before) == want


def test_every_launcher_uses_it():
    for script in ("scripts/run.sh", "scripts/slurm/train.sbatch", "scripts/slurm/train-single-node.sbatch"):
        text = (REPO / script).read_text()
        assert "cuda_connections.sh" in text and "set_cuda_connections" in text, script
        assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in text, script
