"""Tests of the environment protocol helpers (rljax.envs.base) and the env registry."""

import asyncio
import hashlib

import pytest

from rljax import envs
from rljax.chat import ParsedResponse
from rljax.chat.tool_calls import ToolCallError, make_tool_call


def test_task_validation():
    assert envs.Task("a", {"x": 1}).split == "train"
    with pytest.raises(ValueError, match="non-empty string"):
        envs.Task("")
    with pytest.raises(ValueError, match="split"):
        envs.Task("a", split="validation")


def test_action_is_the_text_and_carries_the_parse():
    call = make_tool_call("lookup", {"key": "zob"})
    err = ToolCallError("{oops", "invalid JSON")
    parsed = ParsedResponse("hi", "think", [call], [err], False)
    a = envs.Action.from_parsed("<think>think</think>hi<tool_call>...", parsed)
    assert isinstance(a, str) and a == "<think>think</think>hi<tool_call>..."
    assert (a.content, a.reasoning, a.tool_calls, a.tool_call_errors, a.stopped) == (
        "hi",
        "think",
        [call],
        [err],
        False,
    )
    plain = envs.Action("just text")
    assert plain.content == "just text" and plain.tool_calls == [] and plain.stopped


def test_as_step_result_normalizes_and_rejects():
    r = envs.as_step_result(([{"role": "user", "content": "x"}], 1, 0, None))
    assert r == ([{"role": "user", "content": "x"}], 1.0, False, {})
    messages, reward, done, info = r
    assert isinstance(reward, float) and done is False
    with pytest.raises(ValueError, match=r"\(messages, reward, done, info\)"):
        envs.as_step_result(([], 1.0, True))
    with pytest.raises(ValueError, match="reward must be a finite number"):
        envs.as_step_result(([], "1", True, {}))
    with pytest.raises(ValueError, match="reward must be a finite number"):
        envs.as_step_result(([], True, True, {}))
    with pytest.raises(ValueError, match="reward must be a finite number"):
        envs.as_step_result(([], float("nan"), True, {}))
    with pytest.raises(ValueError, match="list of message dicts"):
        envs.as_step_result(({"role": "user"}, 1.0, True, {}))


def test_maybe_await_handles_sync_and_async():
    async def coro():
        return "async"

    async def run():
        return await envs.maybe_await(coro()), await envs.maybe_await("sync")

    assert asyncio.run(run()) == ("async", "sync")


def test_split_of_is_a_stable_hash_partition():
    keys = [f"k{i}" for i in range(2000)]
    splits = [envs.split_of(k) for k in keys]
    # independent recomputation of the rule: first 8 bytes of sha256 as a fraction of 2**64
    want = [
        "test" if int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") / 2.0**64 < 0.2 else "train"
        for k in keys
    ]
    assert splits == want
    assert 0.17 < splits.count("test") / len(keys) < 0.23
    assert {envs.split_of(k, test_fraction=0.0) for k in keys} == {"train"}
    assert {envs.split_of(k, test_fraction=1.0) for k in keys} == {"test"}
    with pytest.raises(ValueError, match="test_fraction"):
        envs.split_of("a", test_fraction=1.5)


def test_registry():
    assert isinstance(envs.make_env("lookup", max_tool_calls=1), envs.ToolLookupEnv)
    assert isinstance(envs.make_env("arithmetic"), envs.Environment)
    assert len(envs.make_tasks("lookup", 3, seed=1, split="test")) == 3
    with pytest.raises(ValueError, match="unknown environment"):
        envs.make_env("chess")
    with pytest.raises(ValueError, match="unknown environment"):
        envs.make_tasks("chess", 1, seed=0)
