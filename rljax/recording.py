"""The step recorder: chat calls in, training :class:`~rljax.types.Step` s out (design §2.1, §4).

Whatever drives the model -- rljax's own environment loop (:mod:`rljax.rollout`), an
OpenAI-compatible gateway in front of a black-box agent harness, a Tinker-style sampling API --
every LLM call of a trajectory becomes one ``Step``: the exact prompt ids the engine got, the
exact completion ids and logprobs it returned, the role of every prompt token, the weight version,
the MoE routing, the stop reason. A :class:`StepRecorder` (one per trajectory) does that
bookkeeping, and decides for each call how its prompt is built::

    rec = StepRecorder(renderer, TrajectoryID("task-7", 0), env="agent", temperature=0.7)
    prompt = rec.prompt_for(messages, tools=tools)          # bridge, or a full render
    completion = await engine.generate(prompt.ids, sampling)
    call = rec.record(prompt, completion)                   # call.reply: the parsed message
    ...                                                     # more calls, any messages
    steps = rec.finish(reward=1.0)                          # one Step per call

**Extension.** A call's messages *extend* an earlier call ``c`` when they are ``c``'s messages,
then ``c``'s reply (the assistant message parsed from the ids ``c`` sampled, or what a front door
answered its client with, ``c.returned``; compared with :func:`same_reply`), then anything new.
Its prompt is then built by the renderer's bridge::

    prompt = c.prompt.ids + c.completion.ids + renderer.bridge_with_roles(c.prompt.ids,
                                                                          c.completion.ids, new)

so it starts with the earlier call's prompt and completion token for token, and
:func:`rljax.data.merge.merge_steps` folds both calls into one training sample. When no earlier
call is extended (the first call, a context reset, a summary replacing the history, an edited
reply, a sub-agent's own conversation, other tools) or the renderer cannot prove the bridge
(the template would rewrite history), the prompt is a full render of the messages given; merging
then starts a new sample. A call whose completion did not end with the end-of-turn token (cut by
``max_tokens``, ended by another stop token) is extended too: the bridge then starts with the
template's closing tokens of that turn (prompt tokens: loss mask 0 after merging), and holds only
where the full render of the messages, with the reply as the client sent it back, is the same ids.
Among several extended calls (sub-agents interleaved with the main agent, a conversation forked
twice) the one with the longest history wins, the latest among equals -- the same rule the merge
uses for token prefixes (prime-rl's longest-prefix extension).

**Roles.** ``Prompt.roles`` has one entry per prompt id: the role of the message whose body the
token is, None for template scaffolding (``Step.prompt_roles``, read by the echo algorithm). A
bridged prompt takes its parent's roles, ``"assistant"`` for every sampled id (the end-of-turn
token included) and the bridge suffix's roles (exactly as :class:`rljax.chat.ChatSession`): None
for closing tokens the template added to a cut turn, which were not sampled.

**Steps** (what :meth:`StepRecorder.steps` returns, in recording order; the rules of
:mod:`rljax.rollout`):

* ``stop_reason`` is the engine's finish reason ("stop" / "length"), or what was set on the call
  (e.g. "length" when the next prompt no longer fits the context: :meth:`RecordedCall.cut`);
* ``reward`` is each call's reward (default 0; :meth:`StepRecorder.finish` sets the last call's),
  ``is_last_step`` is True on the last step only;
* ``policy_version`` is the completion's ``weight_version``, ``routed_experts`` its routing
  (passed through unchanged), ``temperature`` the sampling temperature, 1.0 for greedy requests
  (< :data:`GREEDY_EPS`: the engines' greedy logprobs are at temperature 1);
* an errored trajectory (:meth:`StepRecorder.fail`, or a completion that finished with "abort")
  gets loss mask 0 and reward 0 on every step, and its last step the stop reason "error" or
  "abort": nothing partial is ever trained on (design §2.1, :data:`rljax.types.ERROR_STOP_REASONS`).

>>> from rljax.chat import ChatMLRenderer, toy_tokenizer
>>> from rljax.inference.engine import Completion
>>> renderer = ChatMLRenderer(toy_tokenizer("chatml"))
>>> rec = StepRecorder(renderer, ("q", 0))
>>> history = [{"role": "user", "content": "hi"}]
>>> p0 = rec.prompt_for(history)
>>> end_of_turn = renderer.stop_token_ids()[0]
>>> ids = renderer.tokenizer.encode("yo", add_special_tokens=False) + [end_of_turn]
>>> c0 = rec.record(p0, Completion(ids, [-0.5] * len(ids), "stop", weight_version=3))
>>> c0.reply
{'role': 'assistant', 'content': 'yo'}
>>> p1 = rec.prompt_for([*history, c0.reply, {"role": "user", "content": "bye"}])
>>> p1.parent, p1.ids[: len(p0.ids) + len(ids)] == [*p0.ids, *ids]
(0, True)
>>> p2 = rec.prompt_for([{"role": "user", "content": "summary: hi, yo"}])   # a context reset
>>> p2.extended
False
>>> _ = rec.record(p1, Completion(ids, [-0.5] * len(ids), "stop", weight_version=4))
>>> [(s.policy_version, s.is_last_step, s.reward) for s in rec.finish(reward=1.0)]
[(3, False, 0.0), (4, True, 1.0)]
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rljax.chat.base import Message, ParsedResponse, Renderer, check_messages
from rljax.chat.session import body_roles
from rljax.inference.engine import Completion
from rljax.types import ERROR_STOP_REASONS, Reward, Step, TrajectoryID

__all__ = [
    "GREEDY_EPS",
    "Prompt",
    "RecordedCall",
    "StepRecorder",
    "recorded_temperature",
    "same_reply",
]

#: Temperatures below this are greedy requests (vLLM's ``_SAMPLING_EPS``, as in
#: :data:`rljax.inference.sampler.GREEDY_EPS`).
GREEDY_EPS = 1e-5


def recorded_temperature(temperature: float) -> float:
    """The temperature a Step records for a request sampled at ``temperature``.

    The trainer divides logits by ``Step.temperature`` to recompute the sampler's logprobs; the
    engines return greedy requests' logprobs at temperature 1, so greedy records 1.0.

    >>> recorded_temperature(0.7), recorded_temperature(0.0)
    (0.7, 1.0)
    """
    return float(temperature) if temperature >= GREEDY_EPS else 1.0


def _text_of(content: Any) -> Any:
    """Message content as text: None -> "", OpenAI content parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        if all(p.get("type", "text") == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content)
    return content


def _calls_of(message: Message) -> list[tuple[Any, Any]]:
    """``(name, arguments)`` of each tool call, JSON-string arguments decoded (OpenAI's wire form)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), args))
    return out


def same_reply(sent: Message, generated: Message) -> bool:
    """Whether ``sent``, an assistant message a client sends back, is the reply it was given.

    ``generated`` is the message parsed from the sampled ids (:meth:`RecordedCall.reply`).
    Clients re-serialize replies, so the comparison is of what the message says, not of its
    spelling: the role must be "assistant"; the content must be equal (None counts as "", a
    list of text parts as their concatenated text); the tool calls must have the same names and
    arguments in the same order (arguments compared as JSON values, so a JSON string equals the
    dict it encodes; call ids and types are ignored); the reasoning must be equal when the client
    sends one (``reasoning_content`` or ``reasoning``) -- clients often drop it, and the sampled
    ids that the bridge reuses keep it anyway.

    >>> gen = {"role": "assistant", "content": "", "tool_calls": [
    ...     {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    >>> same_reply({"role": "assistant", "content": None, "tool_calls": [
    ...     {"id": "call_9", "function": {"name": "f", "arguments": '{"x": 1}'}}]}, gen)
    True
    >>> same_reply({"role": "assistant", "content": "edited"}, gen)
    False
    """
    if sent.get("role") != "assistant" or generated.get("role") != "assistant":
        return False
    if _text_of(sent.get("content")) != _text_of(generated.get("content")):
        return False
    if _calls_of(sent) != _calls_of(generated):
        return False
    for key in ("reasoning_content", "reasoning"):
        if sent.get(key) is not None:
            return sent[key] == (generated.get("reasoning_content") or generated.get("reasoning"))
    return True


@dataclasses.dataclass(frozen=True)
class Prompt:
    """The prompt of one call, ready for ``engine.generate(prompt.ids, ...)``.

    Attributes:
      ids: the exact prompt token ids.
      roles: one entry per id (the role whose message body the token is, None for scaffolding),
        or None when unknown (prompts given as ids without roles).
      parent: index of the recorded call whose prompt + completion ids this prompt starts with
        (it was built by the bridge, or given as ids with that prefix); None for full renders.
      messages: the conversation the ids render (None for prompts given as ids).
      tools: the tool specs rendered with it.

    Treat it as read-only: the recorder keeps it as the call's prompt.
    """

    ids: list[int]
    roles: list[str | None] | None
    parent: int | None = None
    messages: list[dict[str, Any]] | None = dataclasses.field(default=None, repr=False)
    tools: list[Any] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.roles is not None and len(self.roles) != len(self.ids):
            raise ValueError(f"Prompt has {len(self.ids)} ids but {len(self.roles)} roles")

    @property
    def extended(self) -> bool:
        """True when the prompt extends an earlier call's prompt + completion (same sample)."""
        return self.parent is not None


@dataclasses.dataclass(eq=False)
class RecordedCall:
    """One recorded call: its prompt, the engine's completion, and what its Step will carry.

    Attributes:
      index: position in the trajectory (``StepRecorder.calls[index]``).
      prompt: the :class:`Prompt` the engine was given.
      completion: the engine's :class:`~rljax.inference.engine.Completion` (exact ids, logprobs,
        finish reason, weight version, routed experts).
      temperature: the temperature the Step records (:func:`recorded_temperature`).
      reward: the Step's reward (scalar, or one per completion token); settable.
      stop_reason: the Step's stop reason, initially the completion's finish reason; settable.
      returned: the assistant message the caller was answered with, when a front door answers a
        client (the gateway sets it); None means :attr:`reply` is what was returned.
    """

    index: int
    prompt: Prompt
    completion: Completion
    temperature: float
    reward: Reward = 0.0
    stop_reason: str = ""
    renderer: Renderer | None = dataclasses.field(default=None, repr=False)
    returned: dict[str, Any] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.stop_reason:
            self.stop_reason = self.completion.finish_reason

    @functools.cached_property
    def parsed(self) -> ParsedResponse:
        """Content, reasoning and tool calls parsed from the completion ids (computed once)."""
        if self.renderer is None:
            raise ValueError("this call was recorded without a renderer; it cannot be parsed")
        return self.renderer.parse_response(self.completion.ids)

    @property
    def reply(self) -> dict[str, Any]:
        """The assistant message of the completion (what a client is answered with)."""
        return self.parsed.to_message()

    def cut(self, stop_reason: str = "length") -> None:
        """Ends the trajectory at this call with ``stop_reason`` (e.g. the next prompt would not
        fit the context: the trajectory was cut by its length)."""
        self.stop_reason = stop_reason


class StepRecorder:
    """Records the LLM calls of one trajectory as Steps; builds each call's prompt.

    Args:
      renderer: the chat format (:mod:`rljax.chat`).
      trajectory_id: the trajectory (a :class:`~rljax.types.TrajectoryID` or an
        ``(instance_id, repetition_id)`` pair); ``instance_id`` is the GRPO group key.
      env: environment name recorded on the steps.
      algorithm: algorithm name recorded on the steps (design §3.6).
      temperature: the sampling temperature of the calls (per call: ``record(temperature=)``).
      bridge: extend earlier calls when possible; False renders every prompt in full.
      same_reply: ``(sent, generated) -> bool``, whether a message a client sends back is the
        reply a call generated (default :func:`same_reply`).
    """

    def __init__(
        self,
        renderer: Renderer,
        trajectory_id: TrajectoryID | tuple[str, int] | Mapping[str, Any],
        *,
        env: str = "default",
        algorithm: str = "grpo",
        temperature: float = 1.0,
        bridge: bool = True,
        same_reply: Callable[[Message, Message], bool] = same_reply,
    ) -> None:
        self.renderer = renderer
        self.trajectory_id = TrajectoryID.coerce(trajectory_id)
        self.env = env
        self.algorithm = algorithm
        self.temperature = float(temperature)
        self.bridge = bool(bridge)
        self.same_reply = same_reply
        self._calls: list[RecordedCall] = []
        self._error: str | None = None

    # -- prompts --------------------------------------------------------------------------
    @property
    def calls(self) -> tuple[RecordedCall, ...]:
        """The recorded calls, in recording order."""
        return tuple(self._calls)

    @property
    def error(self) -> str | None:
        """None, or the stop reason ("error" / "abort") of an errored trajectory."""
        return self._error

    def prompt_for(self, messages: Sequence[Message], *, tools: Sequence[Any] | None = None) -> Prompt:
        """The prompt for a call on the whole conversation ``messages`` (an OpenAI request's).

        Bridged from the earlier call whose messages + reply ``messages`` extends (the longest
        such history, the latest among equals), else a full render of ``messages``.
        """
        messages = [dict(m) for m in check_messages(messages)]
        tools = None if tools is None else list(tools)
        parent = self._parent_of(messages, tools) if self.bridge else None
        return self._prompt(messages, tools, parent)

    def continue_with(self, new_messages: Sequence[Message], *, call: int = -1) -> Prompt:
        """The prompt after call ``call`` (default the last) was answered with ``new_messages``.

        The environment-loop form of :meth:`prompt_for`: the conversation is that call's
        messages, its parsed reply, then ``new_messages`` (which may be empty).
        """
        if not self._calls:
            raise ValueError("continue_with needs a recorded call: record one first")
        parent = self._calls[call]
        if parent.prompt.messages is None:
            raise ValueError(f"call {parent.index} was given as ids, not messages: use prompt_for")
        new_messages = [dict(m) for m in check_messages(new_messages, allow_empty=True)]
        messages = [*parent.prompt.messages, parent.reply, *new_messages]
        return self._prompt(messages, parent.prompt.tools, parent.index if self.bridge else None)

    def prompt_from_ids(self, ids: Sequence[int], roles: Sequence[str | None] | None = None) -> Prompt:
        """A prompt given as token ids (a token-in API); ``parent`` is the call with the longest
        prompt + completion that ``ids`` starts with (the latest among equals), if any."""
        ids = [int(i) for i in ids]
        parent, best = None, -1
        for c in self._calls:
            full = [*c.prompt.ids, *c.completion.ids]
            if len(full) >= best and ids[: len(full)] == full and len(ids) >= len(full):
                parent, best = c.index, len(full)
        return Prompt(ids, None if roles is None else list(roles), parent)

    def _parent_of(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> int | None:
        parent, best = None, -1
        for c in self._calls:
            prev = c.prompt.messages
            if prev is None or c.prompt.tools != tools or len(messages) <= len(prev) or len(prev) < best:
                continue
            answered = c.returned if c.returned is not None else c.reply  # what the caller got
            if messages[: len(prev)] == prev and self.same_reply(messages[len(prev)], answered):
                parent, best = c.index, len(prev)
        return parent

    def _prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None, parent: int | None) -> Prompt:
        """Bridge from call ``parent`` (``messages`` = its messages + reply + new ones), else render."""
        if parent is not None:
            c = self._calls[parent]
            completion = list(c.completion.ids)
            held = len(c.prompt.messages or ())
            suffix = self.renderer.bridge_with_roles(
                c.prompt.ids, completion, messages[held + 1 :], tools=tools, reply=messages[held]
            )
            if suffix is not None and c.prompt.roles is not None:
                ids = [*c.prompt.ids, *completion, *suffix.ids]
                roles = [*c.prompt.roles, *["assistant"] * len(completion), *body_roles(suffix)]
                return Prompt(ids, roles, parent, messages, tools)
        rendered = self.renderer.render_with_roles(messages, add_generation_prompt=True, tools=tools)
        return Prompt(list(rendered.ids), body_roles(rendered), None, messages, tools)

    # -- calls and steps ------------------------------------------------------------------
    def record(
        self,
        prompt: Prompt,
        completion: Completion,
        *,
        temperature: float | None = None,
        reward: Reward = 0.0,
    ) -> RecordedCall:
        """Records one call: ``completion`` is what the engine returned for ``prompt.ids``.

        A completion that finished with "abort" errors the trajectory (:meth:`fail`). An empty
        completion is not a step: it raises ``ValueError``.

        Args:
          prompt: from :meth:`prompt_for`, :meth:`continue_with` or :meth:`prompt_from_ids`.
          completion: the engine's completion of exactly ``prompt.ids``.
          temperature: this call's sampling temperature (default the recorder's).
          reward: the step's reward (settable later: ``call.reward`` or :meth:`finish`).
        """
        if not isinstance(prompt, Prompt):
            raise TypeError(f"record needs a Prompt (from prompt_for), got {type(prompt).__name__}")
        if not len(completion.ids):
            raise ValueError("the completion has no token ids: an empty completion is not a step")
        temp = self.temperature if temperature is None else temperature
        call = RecordedCall(
            index=len(self._calls),
            prompt=prompt,
            completion=completion,
            temperature=recorded_temperature(temp),
            reward=reward,
            renderer=self.renderer,
        )
        self._calls.append(call)
        if completion.finish_reason == "abort":
            self.fail("abort")
        return call

    def fail(self, stop_reason: str = "error") -> None:
        """Marks the trajectory errored: its steps get loss mask 0 and reward 0, and the last
        one ``stop_reason`` ("error": environment / harness failure, "abort": engine)."""
        if stop_reason not in ERROR_STOP_REASONS:
            raise ValueError(f"fail's stop_reason must be one of {ERROR_STOP_REASONS}, got {stop_reason!r}")
        self._error = stop_reason

    def steps(self) -> list[Step]:
        """One Step per recorded call, in recording order (see the module docstring)."""
        error = self._error
        out = []
        for c in self._calls:
            last = c.index == len(self._calls) - 1
            ids = list(c.completion.ids)
            out.append(
                Step(
                    prompt_ids=list(c.prompt.ids),
                    response_ids=ids,
                    trajectory_id=self.trajectory_id,
                    loss_mask=[0 if error else 1] * len(ids),
                    response_logprobs=list(c.completion.logprobs),
                    reward=0.0 if error else c.reward,
                    is_last_step=last,
                    stop_reason=error if (error and last) else c.stop_reason,
                    env=self.env,
                    algorithm=self.algorithm,
                    temperature=c.temperature,
                    policy_version=c.completion.weight_version,
                    prompt_roles=None if c.prompt.roles is None else list(c.prompt.roles),
                    routed_experts=getattr(c.completion, "routed_experts", None),
                    response_versions=_response_versions(c.completion),
                    response_support_floors=_support_floors(c.completion),
                )
            )
        return out

    def finish(self, reward: Reward | None = None) -> list[Step]:
        """The trajectory's steps; ``reward`` (when given) goes on the last call (outcome reward)."""
        if reward is not None:
            if not self._calls:
                raise ValueError("finish(reward=...) needs a recorded call to put the reward on")
            self._calls[-1].reward = reward
        return self.steps()


def _support_floors(completion: Any) -> list[float] | None:
    """The support floors of a completion's top-k / top-p draws (None: drawn from the whole
    distribution, or not reported)."""
    floors = getattr(completion, "support_floors", None)
    return None if floors is None else list(floors)


def _response_versions(completion: Any) -> list[int] | None:
    """Per-token versions of a completion an in-flight weight update crossed; None for one version."""
    spans = getattr(completion, "weight_versions", ())
    return completion.token_versions() if len(spans) > 1 else None
