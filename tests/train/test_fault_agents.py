"""An agent process that never exits (``config.envs.<name>.agent_command``): at its deadline
(``env_timeout_s``) it is killed together with everything it started, its trajectory is counted as
``env_timeout`` and masked, and the other rollouts train on."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gateway"))
from gateway_helpers import CHATML, Loop, Scripted  # noqa: E402 (after the path insert)

from rljax.agents import CommandAgent, agent_rollout  # noqa: E402
from rljax.envs.base import Task  # noqa: E402
from rljax.gateway import Gateway  # noqa: E402
from rljax.rollout import RolloutConfig  # noqa: E402

pytestmark = pytest.mark.subprocess  # agent processes

AGENT = """
import json, os, subprocess, sys, time, urllib.request

task = json.loads(os.environ["RLJAX_TASK"])
body = {"model": "m", "messages": [{"role": "user", "content": task["id"]}]}
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
)
json.load(urllib.request.urlopen(request))
if task["data"].get("hang"):  # a helper process of its own, then never exit
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(task["data"]["pids"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(3600)
print(json.dumps({"reward": 1.0}))
"""


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_an_agent_that_never_exits_is_killed_with_its_children_and_counted(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    pids = tmp_path / "pids.txt"
    tasks = [Task(f"t{i}", {"hang": i == 3, "pids": str(pids)}) for i in range(10)]  # 10%: one never exits
    config = RolloutConfig(group_size=1, max_tokens=16, max_context_len=512, env_timeout_s=15.0)
    loop, gateway = Loop(), Gateway(CHATML)

    async def main():
        try:
            return await agent_rollout(
                tasks, agent=CommandAgent(f"{sys.executable} {script}"), engine=Scripted(lambda p: "ok"),
                gateway=gateway, config=config,
            )  # fmt: skip
        finally:
            await gateway.stop()

    start = time.monotonic()
    try:
        result = loop.run(main)
    finally:
        loop.close()
    seconds = time.monotonic() - start
    m = result.metrics
    assert (m["num_completed"], m["errored_env_timeout"], m["num_errored"]) == (9, 1, 1)
    (hung,) = [r for r in result.trajectories if r.errored]
    assert str(hung.trajectory_id) == "t3#0" and "env_timeout_s=15.0" in hung.error
    assert all(set(s.loss_mask) == {0} for s in hung.steps)  # its call is never trained on
    assert [r.reward for r in result.trajectories if not r.errored] == [1.0] * 9
    agent_pid, child_pid = map(int, pids.read_text().split())
    deadline = time.monotonic() + 30  # SIGKILL is immediate; this only guards the poll
    while (alive(agent_pid) or alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(agent_pid) and not alive(child_pid)  # the agent and the process it started
    print(f"\nagent past its deadline: rollout of 10 took {seconds:.1f}s (env_timeout_s=15)")
