"""Tests of the agent loop (rljax.rollout).

A scripted fake engine gives deterministic multi-turn checks (what it returned is logged per
session and turn, independently of the rollout, so "ids trained == ids sampled" is checked
against the engine's own record); the embedded sampler with a tiny random Qwen3-shaped model and
the toy byte-level tokenizer checks the real path end to end (logprobs against the model's full
forward, bridged prompts, validation, merging).
"""

import asyncio
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import rollout as rollout_lib
from rljax.chat import ChatMLRenderer, Qwen3Renderer, toy_tokenizer
from rljax.data.merge import merge_steps
from rljax.envs import ArithmeticEnv, Task, ToolLookupEnv, make_arithmetic_tasks, make_lookup_tasks
from rljax.inference.engine import Completion, Engine
from rljax.inference.sampler import EmbeddedSampler
from rljax.models import sequence_logprobs, tiny_model
from rljax.rollout import RolloutConfig as _RolloutConfig
from rljax.rollout import rollout, run_rollout


def RolloutConfig(**kwargs) -> _RolloutConfig:  # noqa: N802  (stands in for the class in these tests)
    """These tests were written for long contexts and turns; the class defaults are the default
    recipe's (a tiny model: 3 turns of 64 tokens in 512), so pin the values they assume."""
    long = dict(max_turns=8, max_tokens=256, max_context_len=4096, max_concurrency=64, group_size=4)
    return _RolloutConfig(**{**long, **kwargs})


TOK = toy_tokenizer("chatml")
RENDERER = Qwen3Renderer(TOK)
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
CALL = '<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{}"}}}}\n</tool_call>'


class ScriptedEngine:
    """Answers from ``script(session_id, turn, prompt_ids) -> (text, finish)``; logs every call.

    Text is tokenized here (as a model "would have sampled" it; a list is taken as ids) and the
    stop token appended for finish "stop"; each id gets a distinct made-up logprob. Random small
    delays interleave the trajectories.
    """

    def __init__(self, script, *, version=7, delay=0.003, fail=None):
        self.script = script
        self.weight_version = version
        self.delay = delay
        self.fail = fail or (lambda session_id, turn: None)
        self.log = {}  # session -> list of (prompt, sampling, completion)
        self.in_flight = 0
        self.max_in_flight = 0
        self.rng = random.Random(0)

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        calls = self.log.setdefault(session_id, [])
        turn = len(calls)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay * self.rng.random())
            failure = self.fail(session_id, turn)
            if failure == "raise":
                calls.append((list(prompt_ids), sampling, None))
                raise ConnectionError("server went away")
            text, finish = self.script(session_id, turn, list(prompt_ids))
            ids = list(text) if isinstance(text, list) else TOK.encode(text, add_special_tokens=False)
            ids = ids[: sampling.max_tokens]
            if finish == "stop":
                ids = ids[: sampling.max_tokens - 1] + [IM_END]
            finish = "abort" if failure == "abort" else finish
            logprobs = [-0.01 * (1 + (7 * i + turn) % 13) for i in range(len(ids))]
            completion = Completion(tuple(ids), tuple(logprobs), finish, self.weight_version)
            calls.append((list(prompt_ids), sampling, completion))
            return completion
        finally:
            self.in_flight -= 1

    async def update_weights(self, model, *, version=None):
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version


def lookup_script(wrong_reps=()):
    """Turn 0: the right tool call; turn 1: the answer (wrong for repetitions in ``wrong_reps``)."""

    def script(session_id, turn, prompt):
        task_id, rep = session_id.rsplit("#", 1)
        text = RENDERER.decode(prompt)
        key = text.rsplit("What color is the ", 1)[1].split("?", 1)[0]
        if turn == 0:
            return CALL.format(key), "stop"
        answer = text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
        return ("purple" if int(rep) in wrong_reps else answer), "stop"

    return script


def by_trajectory(batch):
    out = {}
    for step in batch:
        out.setdefault(str(step.trajectory_id), []).append(step)
    return out


# ------------------------------------------------------------------------------------------------
# scripted engine: exact ids, rewards, bridging, metrics
# ------------------------------------------------------------------------------------------------


def test_multi_turn_ids_trained_equal_ids_sampled():
    tasks = make_lookup_tasks(3, seed=0)
    engine = ScriptedEngine(lookup_script(wrong_reps=(1,)))
    config = RolloutConfig(group_size=3, max_tokens=64, temperature=0.8)
    result = run_rollout(tasks, engine=engine, renderer=RENDERER, make_env=ToolLookupEnv, config=config)
    batch, metrics = result.batch, result.metrics
    trajectories = by_trajectory(batch)
    assert list(trajectories) == [f"{t.id}#{r}" for t in tasks for r in range(3)]  # deterministic order
    for session_id, steps in trajectories.items():
        log = engine.log[session_id]
        assert len(steps) == len(log) == 2
        for step, (prompt, sampling, completion) in zip(steps, log, strict=True):
            assert list(step.prompt_ids) == prompt  # what the engine received
            assert len(step.prompt_roles) == len(prompt)  # one role per prompt id (echo reads them)
            assert list(step.response_ids) == list(completion.ids)  # exactly what it returned
            assert list(step.response_logprobs) == list(completion.logprobs)
            assert list(step.loss_mask) == [1] * len(completion.ids)
            assert step.policy_version == 7 and step.env == "lookup" and step.temperature == 0.8
            assert step.stop_reason == "stop" and step.algorithm == "grpo"
            assert sampling.stop_token_ids == tuple(RENDERER.stop_token_ids())
            assert sampling.temperature == 0.8 and sampling.max_tokens == 64
        first, second = steps
        # bridged: the next prompt extends prompt + completion token for token
        assert list(second.prompt_ids[: first.num_tokens]) == list(first.prompt_ids) + list(
            first.response_ids
        )
        assert RENDERER.decode(second.prompt_ids[first.num_tokens :]).startswith(
            "\n<|im_start|>user\n<tool_response>"
        )
        assert [s.is_last_step for s in steps] == [False, True]
        wrong = session_id.endswith("#1")
        assert [s.reward for s in steps] == [0.0, 0.4 if wrong else 1.0]
        assert steps[0].trajectory_id.instance_id == session_id.rsplit("#", 1)[0]
    assert metrics["num_trajectories"] == 9 and metrics["num_errored"] == 0
    assert metrics["reward_mean"] == pytest.approx((6 * 1.0 + 3 * 0.4) / 9)
    assert metrics["turns_mean"] == 2 and metrics["bridged_fraction"] == 1.0
    assert metrics["response_tokens"] == sum(len(s.response_ids) for s in batch)
    assert metrics["reward_mean/lookup"] == metrics["reward_mean"]
    # the records tell the same story
    assert [r.reward for r in result.trajectories][:3] == [1.0, 0.4, 1.0]
    assert all(r.end == "done" and r.infos[-1]["correct"] != (r.reward < 1) for r in result.trajectories)
    # merging a bridged linear trajectory gives one sample whose trainable tokens are the samples
    merged = by_trajectory(merge_steps(batch))
    for session_id, (sample,) in merged.items():
        trained = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if m]
        assert trained == [t for _, _, c in engine.log[session_id] for t in c.ids]


def test_full_render_mode_and_env_algorithm_override():
    tasks = make_lookup_tasks(1, seed=3)
    engine = ScriptedEngine(lookup_script())
    config = RolloutConfig(group_size=1, bridge=False, env_algorithms={"lookup": "echo"})
    result = run_rollout(tasks, engine=engine, renderer=RENDERER, make_env=ToolLookupEnv, config=config)
    steps = list(result.batch)
    env = ToolLookupEnv()
    messages = env.reset(tasks[0])
    call = RENDERER.parse_response(steps[0].response_ids).to_message()
    tool = env.step(CALL.format(tasks[0].data["query"])).messages
    expected = RENDERER.render_ids([*messages, call, *tool], add_generation_prompt=True, tools=env.tools)
    assert list(steps[1].prompt_ids) == expected
    assert [len(s.prompt_roles) for s in steps] == [len(s.prompt_ids) for s in steps]
    assert result.metrics["bridged_fraction"] == 0.0
    assert {s.algorithm for s in steps} == {"echo"} and steps[-1].reward == 1.0


def test_env_exceptions_mark_the_trajectory_errored_and_masked():
    class Flaky(ToolLookupEnv):
        def reset(self, task):
            if task.id.endswith(":1"):
                raise RuntimeError("cannot start")
            return super().reset(task)

        def step(self, action):
            if self.task.id.endswith(":2") and self.num_calls == 1:
                raise KeyError("tool backend down")
            return super().step(action)

    tasks = make_lookup_tasks(3, seed=0)
    for on_error in ("mask", "drop"):
        result = run_rollout(
            tasks,
            engine=ScriptedEngine(lookup_script()),
            renderer=RENDERER,
            make_env=Flaky,
            config=RolloutConfig(group_size=2, on_error=on_error),
        )
        trajectories = by_trajectory(result.batch)
        ok = trajectories[f"{tasks[0].id}#0"]
        assert [s.reward for s in ok] == [0.0, 1.0] and all(all(s.loss_mask) for s in ok)
        assert f"{tasks[1].id}#0" not in trajectories  # reset failed: nothing was sampled
        if on_error == "mask":
            bad = trajectories[f"{tasks[2].id}#1"]
            assert len(bad) == 2
            assert all(set(s.loss_mask) == {0} for s in bad)
            assert [s.reward for s in bad] == [0.0, 0.0]
            assert [s.stop_reason for s in bad] == ["stop", "error"] and bad[-1].is_last_step
        else:
            assert set(trajectories) == {f"{tasks[0].id}#{r}" for r in range(2)}
        m = result.metrics
        assert (m["num_errored"], m["errored_env"], m["num_completed"]) == (4, 4, 2)
        assert m["reward_mean"] == 1.0  # errored trajectories are counted, not averaged in
        errors = [r.error for r in result.trajectories if r.errored]
        assert any("cannot start" in e for e in errors) and any("tool backend down" in e for e in errors)


@pytest.mark.parametrize("failure", ["raise", "abort"])
def test_engine_failures_never_train_on_partial_data(failure):
    tasks = make_lookup_tasks(2, seed=1)
    bad_session = f"{tasks[1].id}#0"
    engine = ScriptedEngine(
        lookup_script(), fail=lambda sid, turn: failure if (sid == bad_session and turn == 1) else None
    )
    result = run_rollout(
        tasks, engine=engine, renderer=RENDERER, make_env=ToolLookupEnv, config=RolloutConfig(group_size=2)
    )
    trajectories = by_trajectory(result.batch)
    bad = trajectories[bad_session]
    assert len(bad) == (1 if failure == "raise" else 2)
    assert all(set(s.loss_mask) == {0} and s.reward == 0.0 for s in bad)
    assert bad[-1].stop_reason == "abort" and bad[-1].is_last_step
    assert result.metrics["errored_engine"] == 1 and result.metrics["num_completed"] == 3
    for sid, steps in trajectories.items():
        if sid != bad_session:
            assert steps[-1].reward == 1.0 and all(all(s.loss_mask) for s in steps)


def test_bad_engine_ids_and_bad_rewards_error_only_their_trajectory():
    tasks = make_arithmetic_tasks(2, seed=0)

    class NanReward(ArithmeticEnv):
        def step(self, action):
            result = super().step(action)
            return result._replace(reward=float("nan")) if self.task.id == tasks[0].id else result

    engine = ScriptedEngine(lambda sid, turn, prompt: ([300] if sid.endswith("#1") else "1", "stop"))
    result = run_rollout(
        tasks,
        engine=engine,
        renderer=RENDERER,
        make_env=NanReward,
        config=RolloutConfig(group_size=2),
        vocab_size=270,
    )
    kinds = {str(r.trajectory_id): r.error_kind for r in result.trajectories}
    assert kinds == {
        f"{tasks[0].id}#0": "env",
        f"{tasks[0].id}#1": "engine",
        f"{tasks[1].id}#0": None,
        f"{tasks[1].id}#1": "engine",
    }
    assert len(result.batch) == 2  # the out-of-vocabulary completions were never recorded
    assert [s.loss_mask for s in result.batch][1] == [1, 1]


def test_truncated_turn_ends_the_trajectory_with_length():
    seen = []

    class Recording(ToolLookupEnv):
        def step(self, action):
            seen.append(action.stopped)
            return super().step(action)

    engine = ScriptedEngine(lambda sid, turn, prompt: ("x" * 100, "length"))
    result = run_rollout(
        make_lookup_tasks(1, seed=0),
        engine=engine,
        renderer=RENDERER,
        make_env=Recording,
        config=RolloutConfig(group_size=2, max_tokens=5),
    )
    assert seen == [False, False]  # the env judged the truncated turns
    for step in result.batch:
        assert step.stop_reason == "length" and len(step.response_ids) == 5 and step.is_last_step
        assert all(step.loss_mask)  # exact tokens: masking overlong turns is the overlong filter's job


def test_context_limit_caps_the_turn_budget_and_stops_with_length():
    tasks = make_lookup_tasks(1, seed=0)
    probe = ScriptedEngine(lookup_script())
    first = run_rollout(
        tasks, engine=probe, renderer=RENDERER, make_env=ToolLookupEnv, config=RolloutConfig(group_size=1)
    )
    s0, s1 = first.batch
    # room for the first turn, but the second prompt does not fit: the trajectory ends after turn 0
    limit = len(s1.prompt_ids) - 1
    engine = ScriptedEngine(lookup_script())
    result = run_rollout(
        tasks,
        engine=engine,
        renderer=RENDERER,
        make_env=ToolLookupEnv,
        config=RolloutConfig(group_size=1, max_context_len=limit, max_tokens=4096),
    )
    (step,) = result.batch
    assert step.stop_reason == "length" and step.is_last_step
    ((_, sampling, _),) = engine.log[str(step.trajectory_id)]
    assert sampling.max_tokens == limit - len(s0.prompt_ids)  # min(max_tokens, context - prompt)
    assert result.trajectories[0].end == "length" and result.metrics["end_length_fraction"] == 1.0
    # a prompt that does not fit at all is an error of its own kind, with no steps
    tiny = run_rollout(
        tasks,
        engine=engine,
        renderer=RENDERER,
        make_env=ToolLookupEnv,
        config=RolloutConfig(group_size=1, max_context_len=10, raise_on_all_errored=False),
    )
    assert len(tiny.batch) == 0 and tiny.metrics["errored_prompt_too_long"] == 1
    # by default a rollout with nothing to train on is an error
    with pytest.raises(rollout_lib.RolloutError, match="prompt_too_long"):
        run_rollout(
            tasks,
            engine=engine,
            renderer=RENDERER,
            make_env=ToolLookupEnv,
            config=RolloutConfig(group_size=1, max_context_len=10),
        )


def test_max_turns_and_async_envs():
    class Chatty:
        name = "chatty"
        tools = None

        async def reset(self, task):
            await asyncio.sleep(0)
            self.turn = 0
            return [{"role": "user", "content": "talk"}]

        async def step(self, action):
            await asyncio.sleep(0)
            self.turn += 1
            return [{"role": "user", "content": f"more {self.turn}"}], 0.5 * self.turn, False, {}

    engine = ScriptedEngine(lambda sid, turn, prompt: (f"reply {turn}", "stop"))
    result = run_rollout(
        [Task("c0"), Task("c1")],
        engine=engine,
        renderer=ChatMLRenderer(TOK),
        make_env=Chatty,
        config=RolloutConfig(group_size=1, max_turns=3),
    )
    for steps in by_trajectory(result.batch).values():
        assert [s.reward for s in steps] == [0.5, 1.0, 1.5]  # per-step rewards kept where given
        assert [s.is_last_step for s in steps] == [False, False, True]
        assert {s.env for s in steps} == {"chatty"}
    assert result.metrics["end_max_turns_fraction"] == 1.0 and result.metrics["reward_mean"] == 1.5


def test_concurrency_is_bounded_and_used():
    engine = ScriptedEngine(lookup_script(), delay=0.01)
    tasks = make_lookup_tasks(6, seed=2)
    result = run_rollout(
        tasks,
        engine=engine,
        renderer=RENDERER,
        make_env=ToolLookupEnv,
        config=RolloutConfig(group_size=2, max_concurrency=4),
    )
    assert 1 < engine.max_in_flight <= 4
    assert result.metrics["num_trajectories"] == 12 and result.metrics["reward_mean"] == 1.0


def test_seeds_are_per_request_and_reproducible():
    tasks = make_lookup_tasks(2, seed=0)

    def seeds(config):
        engine = ScriptedEngine(lookup_script())
        run_rollout(tasks, engine=engine, renderer=RENDERER, make_env=ToolLookupEnv, config=config)
        return {sid: [c[1].seed for c in calls] for sid, calls in engine.log.items()}

    a = seeds(RolloutConfig(group_size=2, seed=5))
    assert a == seeds(RolloutConfig(group_size=2, seed=5, max_concurrency=1))
    flat = [s for v in a.values() for s in v]
    assert len(set(flat)) == len(flat) == 8 and all(0 <= s < 2**31 for s in flat)
    assert seeds(RolloutConfig(group_size=2, seed=6)) != a
    assert {s for v in seeds(RolloutConfig(group_size=2)).values() for s in v} == {None}


def test_mixed_environments_and_argument_errors():
    tasks = make_lookup_tasks(1, seed=0) + make_arithmetic_tasks(1, seed=0)
    answer = tasks[1].data["answer"]

    def script(sid, turn, prompt):
        if sid.startswith("arith"):
            return answer, "stop"
        return lookup_script()(sid, turn, prompt)

    factories = {"lookup": ToolLookupEnv, "arithmetic": ArithmeticEnv}
    result = run_rollout(
        tasks,
        engine=ScriptedEngine(script),
        renderer=RENDERER,
        make_env=factories,
        config=RolloutConfig(group_size=1),
    )
    assert result.metrics["reward_mean/arithmetic"] == 1.0 and result.metrics["reward_mean/lookup"] == 1.0
    with pytest.raises(ValueError, match="does not have"):
        run_rollout(
            tasks, engine=ScriptedEngine(script), renderer=RENDERER, make_env={"lookup": ToolLookupEnv}
        )
    with pytest.raises(ValueError, match="unique"):
        run_rollout(tasks + tasks[:1], engine=ScriptedEngine(script), renderer=RENDERER, make_env=factories)
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(ValueError, match="on_error"):
        RolloutConfig(on_error="ignore")
    with pytest.raises(ValueError, match="top_p"):
        RolloutConfig(top_p=0.0)


# ------------------------------------------------------------------------------------------------
# end to end with the embedded sampler
# ------------------------------------------------------------------------------------------------

VOCAB = 272
REF_LEN = 512


def stopping_model():
    """Tiny random Qwen3-shaped decoder biased to end turns: a large constant coordinate of the
    embeddings survives the blocks, and only <|im_end|> reads it, so p(<|im_end|>) ~ 0.15 per token."""
    model = tiny_model(vocab_size=VOCAB)
    embed = model.embed_tokens[...]
    model.embed_tokens[...] = embed.at[:, 0].set(5.0)
    kernel = model.lm_head.kernel[...] * 40.0
    kernel = kernel.at[0, :].set(0.0).at[0, IM_END].set(0.65)
    model.lm_head.kernel[...] = kernel
    return model


@jax.jit
def _ref_logprobs(state, tokens, length, temperature):
    model = nnx.merge(_GRAPHDEF, state)
    segments = (jnp.arange(REF_LEN) < length)[None].astype(jnp.int32)
    return sequence_logprobs(model, tokens[None], segment_ids=segments, temperature=temperature)[0]


_GRAPHDEF = nnx.split(stopping_model())[0]


class Counting:
    """Three turns whatever the model says; reward = number of letters 'a' in the last answer."""

    name = "counting"
    tools = None

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": f"say something ({task.id})"}]

    def step(self, action):
        self.turn += 1
        done = self.turn == 3
        return [{"role": "user", "content": "again"}], float(action.count("a")) if done else 0.0, done, {}


def test_embedded_sampler_end_to_end():
    model = stopping_model()
    sampler = EmbeddedSampler(model, min_prompt_bucket=64, min_new_tokens_bucket=16, min_batch_bucket=8)
    assert isinstance(sampler, Engine)
    config = RolloutConfig(group_size=3, max_turns=3, max_tokens=16, temperature=0.9, seed=0)
    tasks = [Task("p0"), Task("p1")]
    result = run_rollout(
        tasks,
        engine=sampler,
        renderer=ChatMLRenderer(TOK),
        make_env=Counting,
        config=config,
        vocab_size=VOCAB,
    )
    batch = result.batch
    assert result.metrics["num_errored"] == 0 and result.metrics["num_trajectories"] == 6
    state = nnx.state(model)
    stopped = 0
    for steps in by_trajectory(batch).values():
        for step in steps:
            seq = list(step.prompt_ids) + list(step.response_ids)
            padded = jnp.asarray(seq + [0] * (REF_LEN - len(seq)), jnp.int32)
            ref = np.asarray(_ref_logprobs(state, padded, len(seq), jnp.float32(0.9)))
            np.testing.assert_allclose(
                step.response_logprobs, ref[len(step.prompt_ids) : len(seq)], **LOGPROB_TOL
            )
            stopped += step.stop_reason == "stop"
        for prev, nxt in zip(steps, steps[1:], strict=False):
            if prev.response_ids[-1] == IM_END:  # bridged: prompt_{i+1} starts with prompt_i + completion_i
                assert list(nxt.prompt_ids[: prev.num_tokens]) == list(prev.prompt_ids) + list(
                    prev.response_ids
                )
    assert stopped >= 6  # the multi-turn bridged path was exercised
    assert result.metrics["turns_mean"] > 1 and result.metrics["bridged_fraction"] > 0.5
    # a group's repetitions reach the sampler together and their shared prompt is prefilled once
    assert sampler.num_prefilled_tokens < sampler.num_prompt_tokens
    # repetitions of a task sample differently; the same seed reproduces the whole rollout
    first_turns = {tuple(s.response_ids) for s in batch if s.trajectory_id.instance_id == "p0"}
    assert len(first_turns) > 1
    again = run_rollout(
        tasks,
        engine=sampler,
        renderer=ChatMLRenderer(TOK),
        make_env=Counting,
        config=config,
        vocab_size=VOCAB,
    )
    assert [list(s.response_ids) for s in again.batch] == [list(s.response_ids) for s in batch]
    # merged samples train exactly the sampled tokens
    merged = merge_steps(batch)
    trained = sum(int(np.sum(s.loss_mask)) for s in merged)
    assert trained == sum(len(s.response_ids) for s in batch)


def test_async_rollout_api():
    async def main():
        return await rollout(
            make_arithmetic_tasks(2, seed=0),
            engine=ScriptedEngine(lambda sid, turn, prompt: ("0", "stop")),
            renderer=RENDERER,
            make_env=ArithmeticEnv,
            config=RolloutConfig(group_size=2),
        )

    result = asyncio.run(main())
    assert len(result.batch) == 4 and result.batch.metadata["rollout"] is result.metrics


# ------------------------------------------------------------------------------------------------
# robust env execution: timeouts, thread pool, all-errored rollouts, close, env metrics
# ------------------------------------------------------------------------------------------------


class Misbehaving(ArithmeticEnv):
    """Arithmetic, except by task index: 0 hangs in a sync step, 1 hangs in an async-looking
    reset (a sync method returning a coroutine), 2 raises in reset, 3 raises in step."""

    closed = []

    def __init__(self):
        super().__init__()
        self.kind = None

    def reset(self, task):
        self.kind = int(task.id.rsplit(":", 1)[-1])
        if self.kind == 1:
            return asyncio.sleep(30, result=[])
        if self.kind == 2:
            raise RuntimeError("reset exploded")
        return super().reset(task)

    def step(self, action):
        if self.kind == 0:
            import time

            time.sleep(1.5)
        if self.kind == 3:
            raise KeyError("step exploded")
        return super().step(action)

    def close(self):
        Misbehaving.closed.append(self.kind)


def test_hanging_and_raising_envs_are_counted_and_the_rest_trains():
    import time

    tasks = [
        Task(f"m:{i}", {"a": 1, "op": "+", "b": i, "answer": str(1 + i)}, env="arithmetic") for i in range(6)
    ]
    engine = ScriptedEngine(lambda sid, turn, prompt: (str(1 + int(sid.split("#")[0].split(":")[1])), "stop"))
    Misbehaving.closed = []
    start = time.perf_counter()
    result = run_rollout(
        tasks,
        engine=engine,
        renderer=RENDERER,
        make_env=Misbehaving,
        config=RolloutConfig(group_size=2, env_timeout_s=0.4),
    )
    assert time.perf_counter() - start < 1.4  # the hanging calls did not hold the rollout
    kinds = {str(r.trajectory_id): r.error_kind for r in result.trajectories}
    for rep in range(2):
        assert kinds[f"m:0#{rep}"] == "env_timeout" and kinds[f"m:1#{rep}"] == "env_timeout"
        assert kinds[f"m:2#{rep}"] == "env" and kinds[f"m:3#{rep}"] == "env"
        assert kinds[f"m:4#{rep}"] is None and kinds[f"m:5#{rep}"] is None
    errors = {str(r.trajectory_id): r.error for r in result.trajectories}
    assert "env.step took longer" in errors["m:0#0"] and "env.reset took longer" in errors["m:1#0"]
    assert "reset exploded" in errors["m:2#0"] and "step exploded" in errors["m:3#1"]
    m = result.metrics
    assert (m["errored_env_timeout"], m["errored_env"], m["num_completed"]) == (4, 4, 4)
    assert m["reward_mean"] == 1.0
    steps = by_trajectory(result.batch)
    for sid, trajectory in steps.items():
        ok = kinds[sid] is None
        assert all(set(s.loss_mask) == ({1} if ok else {0}) for s in trajectory)
        assert trajectory[-1].stop_reason == ("stop" if ok else "error")  # errored stay identifiable
        assert trajectory[-1].reward == (1.0 if ok else 0.0)
    assert set(steps) == {f"m:{i}#{r}" for i in (0, 3, 4, 5) for r in range(2)}  # 1, 2 never sampled
    assert sorted(Misbehaving.closed) == sorted([0, 1, 2, 3, 4, 5] * 2)  # close always called


def test_sync_envs_run_in_the_thread_pool_and_never_stall_the_loop():
    import threading
    import time

    threads = set()

    class Slow:
        name = "slow"
        tools = None

        def reset(self, task):
            self.turn = 0
            return [{"role": "user", "content": "go"}]

        def step(self, action):
            threads.add(threading.get_ident())
            time.sleep(0.1)
            self.turn += 1
            return [{"role": "user", "content": "more"}], 1.0, self.turn == 2, {}

    engine = ScriptedEngine(lambda sid, turn, prompt: ("ok", "stop"), delay=0.0)
    start = time.perf_counter()
    result = run_rollout(
        [Task(f"s{i}") for i in range(8)],
        engine=engine,
        renderer=RENDERER,
        make_env=Slow,
        config=RolloutConfig(group_size=2, max_concurrency=16),
    )
    wall = time.perf_counter() - start
    assert result.metrics["num_completed"] == 16 and result.metrics["turns_mean"] == 2
    assert wall < 1.2  # 16 x 2 x 0.1 s = 3.2 s if the steps ran on the loop one after another
    assert threading.get_ident() not in threads and len(threads) > 1


def test_a_rollout_where_every_trajectory_errors_raises_with_the_first_traceback():
    class Broken(ArithmeticEnv):
        def reset(self, task):
            return self._explode(task)

        def _explode(self, task):
            raise ZeroDivisionError(f"no env for {task.id}")

    tasks = make_arithmetic_tasks(2, seed=0)
    kwargs = dict(
        engine=ScriptedEngine(lambda sid, turn, prompt: ("1", "stop")), renderer=RENDERER, make_env=Broken
    )
    with pytest.raises(rollout_lib.RolloutError) as err:
        run_rollout(tasks, config=RolloutConfig(group_size=2), **kwargs)
    msg = str(err.value)
    assert "every trajectory of the rollout errored (4" in msg and f"{tasks[0].id}#0 (env)" in msg
    assert "Traceback" in msg and "_explode" in msg and "ZeroDivisionError" in msg
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    result = run_rollout(tasks, config=RolloutConfig(group_size=2, raise_on_all_errored=False), **kwargs)
    assert result.metrics["num_errored"] == 4 and len(result.batch) == 0
    with pytest.raises(ValueError, match="env_timeout_s"):
        RolloutConfig(env_timeout_s=0)
    with pytest.raises(ValueError, match="env_workers"):
        RolloutConfig(env_workers=0)


def test_env_metrics_are_aggregated_per_env():
    class Counted(ArithmeticEnv):
        def get_metrics(self):
            return {"answer_len": len(self.task.data["answer"]), "name": "not a number", "ok": True}

    class CustomAgg(Counted):
        name = "custom"

        @staticmethod
        def aggregate_metrics(metrics):
            return {"count": len(metrics), "skipped": "text"}

    class BadClose(ArithmeticEnv):
        def close(self):
            raise OSError("cannot close")

    tasks = [
        Task("a:1", {"a": 1, "op": "+", "b": 9, "answer": "10"}, env="counted"),
        Task("a:2", {"a": 1, "op": "+", "b": 1, "answer": "2"}, env="counted"),
        Task("b:1", {"a": 1, "op": "+", "b": 2, "answer": "3"}, env="custom"),
        Task("c:1", {"a": 1, "op": "+", "b": 3, "answer": "4"}, env="badclose"),
    ]
    result = run_rollout(
        tasks,
        engine=ScriptedEngine(lambda sid, turn, prompt: ("1", "stop")),
        renderer=RENDERER,
        make_env={"counted": Counted, "custom": CustomAgg, "badclose": BadClose},
        config=RolloutConfig(group_size=2),
    )
    m = result.metrics
    assert m["env/counted/answer_len"] == 1.5 and m["env/counted/ok"] == 1.0
    assert "env/counted/name" not in m
    assert m["env/custom/count"] == 2.0 and "env/custom/skipped" not in m
    assert not any(k.startswith("env/badclose/") for k in m)
    assert m["env_close_errors"] == 2.0 and m["num_errored"] == 0  # a failed close keeps the data
    assert result.trajectories[0].env_metrics == {"answer_len": 2, "name": "not a number", "ok": True}


def test_records_hold_the_recorders_steps_and_drop_leaves_them_out_of_the_batch_only():
    """The env loop's Steps come from rljax.recording.StepRecorder: each record holds its
    trajectory's steps (errored ones masked, kept there under on_error="drop" too)."""
    tasks = make_lookup_tasks(2, seed=0)
    for on_error in ("mask", "drop"):
        engine = ScriptedEngine(
            lookup_script(), fail=lambda sid, turn: "abort" if sid.endswith("#1") and turn == 1 else None
        )
        config = RolloutConfig(group_size=2, max_tokens=64, on_error=on_error)
        result = run_rollout(tasks, engine=engine, renderer=RENDERER, make_env=ToolLookupEnv, config=config)
        kept = [s for r in result.trajectories if on_error == "mask" or not r.errored for s in r.steps]
        assert list(result.batch) == kept
        for rec in result.trajectories:
            log = engine.log[str(rec.trajectory_id)]
            assert [list(s.response_ids) for s in rec.steps] == [list(c.ids) for _, _, c in log]
            assert [list(s.prompt_ids) for s in rec.steps] == [p for p, _, _ in log]
            assert rec.errored == str(rec.trajectory_id).endswith("#1")
            assert [s.stop_reason for s in rec.steps] == ["stop", "abort" if rec.errored else "stop"]
            assert all(set(s.loss_mask) == {0 if rec.errored else 1} for s in rec.steps)
        assert result.metrics["response_tokens"] == sum(
            len(c.ids) for log in engine.log.values() for *_, c in log
        )
