"""docs/rl.md's main job reproduces: the command it prints, run as printed, prints the figures it documents.

Issue 32: the documented figures came out only under a setting the printed command did not make. The command is
read from the page (its environment assignments included) and run in a subprocess, as a reader runs it; the
run's last line (the reward of the first and last 10 steps) must be the page's. About 45 s on two cores.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers.lightning import clean_env

REPO = helpers.REPO


def documented() -> tuple[list[str], dict[str, str], str]:
    """The page's command (its ``NAME=VALUE`` assignments apart) and the reward line its expected output ends with."""
    page = (REPO / "docs" / "rl.md").read_text()
    setup = re.search(r"```bash\n(.*?)\n```", page, flags=re.S).group(1)
    words = shlex.split(setup.split("&&")[-1])
    assignments = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    command = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    (line,) = re.findall(r"^reward: first 10 steps .*$", page, flags=re.M)
    return command, assignments, line


@pytest.mark.long
def test_the_documented_main_job_prints_the_documented_rewards(tmp_path: Path) -> None:
    command, assignments, expected = documented()
    assert command[:2] == ["lightning-dta", "fit"] and assignments == {"OMP_NUM_THREADS": "1"}, (command, assignments)
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"} | assignments
    executable = str(Path(sys.executable).parent / command[0])
    proc = subprocess.run([executable, *command[1:], f"--trainer.logger.init_args.save_dir={tmp_path}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = re.findall(r"^reward: first 10 steps .*$", proc.stdout + proc.stderr, flags=re.M)
    assert line.split(";")[0] == expected.split(";")[0], (line, expected)
    assert os.path.isfile(tmp_path / "toy_rl_cpu" / "version_0" / "reward.png")
