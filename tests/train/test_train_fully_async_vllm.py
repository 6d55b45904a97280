"""``trainer.mode = "fully_async"`` against REAL vLLM (CPU) servers, each run launching its own.

1. Full-weight syncs switched in flight (``engine.in_flight_updates="recompute"``, the
   ``vllm_local`` recipe shrunk): the run trains; every rollout record's ``weight_versions`` spans
   are contiguous, strictly increasing and cover the completion; every token's version is within the
   staleness bound of the step that trains it; ``async/inflight_updates`` is in every row.
   Truthful labels: EVERY sampled token's vLLM logprob equals the trainer's own logprob
   (``rljax.models.sequence_logprobs``, no KV cache) under the weights of the version its span names
   (1e-4, float32), and those weights differ from the other versions' (the check can fail).
   ``rl/mismatch_kl`` is at the float32 level on the first step, where every token is of the
   version trained (the bound of ``test_train_vllm_local.py``).
   The same run loses its server mid-stream: right after the switch to version 1 its process is
   SIGKILLed while the stream samples. The supervisor restarts it (a restarted vLLM serves the
   initial weights, labelled "default") and restores the CURRENT weights under the CURRENT
   label before it serves again: the run finishes, every completion answered after the restore
   carries versions >= the one restored, and the truthful-label check above covers its tokens
   too (a restored server labelled v0 would fail it, or stop the run on a stale sample).
2. LoRA adapter syncs (the ``lora_vllm`` recipe): adapters are swapped while the stream runs. A vLLM
   request names its adapter, so a running request cannot move to a new one: with adapter syncs
   each turn is sampled by ONE adapter version (the one its request named; the next turn names the
   newest). Checked the same way: one span per turn, every token's logprob equals the trainer's
   logprob under the adapter version it is labelled with.

The weights each version served are recorded at the engine's ``serve`` (a copy of the model the
sync sent, adapters included). Runtime: two server start-ups (~20-30 s each), one restart, plus a
few steps.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import os
import signal
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax import models
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm.pause import GENERATE_PATH, InFlightVLLMClient
from rljax.recipes import lora_vllm, vllm_local
from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run import engines as engines_mod
from rljax.run.config import parse_run_config
from rljax.run.trainer import Trainer

LOGPROB_ATOL = 1e-4  # float32 vLLM vs rljax, as the other vLLM parity tests (measured ~1e-6)
MISMATCH_KL_MAX = 1e-3  # as test_train_vllm_local.py
NUM_STEPS = 3
STALENESS = 1  # trainer.max_off_policy_steps


def _shrink(c):
    """The recipe, small: no warm start, 2 prompts x 4 samples per step, short two-turn episodes."""
    c.warmstart.num_steps = 0
    c.envs.lookup.update(num_train_tasks=16, num_eval_tasks=0)
    c.rollout.update(group_size=4, max_turns=2, max_tokens=32, max_concurrency=64)
    c.trainer.update(
        num_steps=NUM_STEPS,
        mode="fully_async",
        max_off_policy_steps=STALENESS,
        prompts_per_step=2,
        mini_batch_prompts=0,
        seq_len=256,
        eval_every=0,
        checkpoint_every=0,
        save_rollouts_every=1,
    )
    # Eager mode skips vLLM's ~30 s torch.compile warm-up; the numerics stay float32.
    c.engine.server.extra_args = (*c.engine.server.extra_args, "--enforce-eager")
    return c


@pytest.fixture
def served_weights(monkeypatch):
    """``{version: model}``: a host copy of the model each weight version's sync sent to vLLM."""
    seen: dict[int, nnx.Module] = {}
    real = engines_mod.EngineSet.serve

    async def recording(self, version, model):
        if version not in seen:
            graphdef, state = nnx.split(self.served(model))
            seen[version] = nnx.merge(graphdef, jax.tree.map(np.array, state))
        return await real(self, version, model)

    monkeypatch.setattr(engines_mod.EngineSet, "serve", recording)
    return seen


def _records(workdir) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): read_rollout_records(p)
        for p in sorted((workdir / ROLLOUTS_DIR).glob("step_*.jsonl"))
    }


def _batched_logprobs(model, rows: list[dict], temperature: float) -> list[np.ndarray]:
    """Per record, the trainer's ``log p(completion token | everything before it)`` (float64), in
    one forward: right padding does not change a causal model's earlier positions."""
    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    width = -(-max(map(len, seqs)) // 64) * 64
    tokens = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    out = np.asarray(models.sequence_logprobs(model, tokens, temperature=float(temperature)), np.float64)
    return [out[i, len(r["prompt_ids"]) : len(s)] for i, (r, s) in enumerate(zip(rows, seqs, strict=True))]


def _check_spans(record: dict, step: int) -> list[int]:
    """Asserts the record's spans are valid and within the staleness bound of the step that trains it
    (row ``step`` trains ``theta_{step-1}``); returns the per-token versions."""
    spans, n = record["weight_versions"], len(record["completion_ids"])
    assert spans, record
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n
    for a, b in itertools.pairwise(spans):
        assert a["end"] == b["start"] and b["version"] > a["version"], spans
    assert all(s["end"] > s["start"] for s in spans), spans
    assert record["weight_version"] == spans[0]["version"]
    versions = [s["version"] for s in spans for _ in range(s["start"], s["end"])]
    trained = step - 1
    assert all(trained - STALENESS <= v <= trained for v in versions), (step, spans)
    return versions


def _check_labels(
    records: dict[int, list[dict]], served: dict, temperature: float
) -> tuple[collections.Counter, float]:
    """Every token's logprob is its labelled version's (within ``LOGPROB_ATOL``); some tokens are
    more than 100x that away from another version's (the check can fail). Returns the tokens checked
    per version and the largest difference seen."""
    rows = [(step, r) for step, rs in sorted(records.items()) for r in rs if r["completion_ids"]]
    refs = {v: _batched_logprobs(m, [r for _, r in rows], temperature) for v, m in served.items()}
    checked: collections.Counter = collections.Counter()
    separated, worst = 0, 0.0
    for i, (step, r) in enumerate(rows):
        versions = np.asarray(_check_spans(r, step))
        got = np.asarray(r["logprobs"], np.float64)
        for v in np.unique(versions):
            at = versions == v
            err = float(np.max(np.abs(got[at] - refs[int(v)][i][at])))
            assert err <= LOGPROB_ATOL, f"step {step}: tokens labelled v{v} are off by {err:.3g}"
            worst = max(worst, err)
            checked[int(v)] += int(at.sum())
            for other, ref in refs.items():
                if other != v:
                    separated += int(np.sum(np.abs(ref[i][at] - got[at]) > 100 * LOGPROB_ATOL))
    assert separated > 0, "no version's weights differ from another's on the sampled tokens: no teeth"
    return checked, worst


def _check_rows(history: list[dict]) -> None:
    assert [h["step"] for h in history] == list(range(1, NUM_STEPS + 1))
    for h in history:
        assert h["rollout/num_errored"] == 0 and h["tokens/rl"] > 0
        assert "async/inflight_updates" in h and h["async/inflight_updates"] >= 0
        assert 0 <= h["async/staleness_max"] <= STALENESS and h["policy_version/lag"] <= STALENESS
        assert h["async/groups_dropped_stale"] == 0
        assert math.isfinite(h["rl/mismatch_kl"])
    # Row 1 trains theta_0 on tokens all sampled by version 0 (nothing was published before it).
    assert history[0]["async/staleness_max"] == 0
    assert abs(history[0]["rl/mismatch_kl"]) < MISMATCH_KL_MAX


@pytest.fixture
def killed_after_first_switch(monkeypatch, served_weights):
    """SIGKILLs the (only) server's process group after the switch to version 1, as soon as the
    stream has requests on it; records ``kill`` (requests in flight then) and every in-flight
    completion ``(time answered, versions)``."""
    seen: dict = {"completions": []}
    serve = engines_mod.EngineSet.serve

    async def kill_when_busy(client):
        while client.in_flight == 0:
            await asyncio.sleep(0.01)
        seen["kill"] = client.in_flight
        os.killpg(client.supervisor.launched[0].process.pid, signal.SIGKILL)

    async def serve_then_kill(self, version, model):
        await serve(self, version, model)
        if version == 1 and "killer" not in seen:  # on the requests' loop, not holding the trainer
            seen["killer"] = asyncio.get_running_loop().create_task(kill_when_busy(self.policy))

    generate = InFlightVLLMClient.generate

    async def recorded(self, *args, **kwargs):
        out = await generate(self, *args, **kwargs)
        seen["completions"].append((time.monotonic(), out.token_versions()))
        return out

    monkeypatch.setattr(engines_mod.EngineSet, "serve", serve_then_kill)
    monkeypatch.setattr(InFlightVLLMClient, "generate", recorded)
    return seen


def _check_restored(client, seen: dict) -> tuple[int, float]:
    """The server was restarted once and restored; every completion answered after it was back
    carries versions >= the one it was restored to (and there are some). Returns that version and
    the seconds from the server going down to it being back in service."""
    assert seen.get("kill", 0) > 0, "the server was not killed while the stream used it"
    events = [e for e in client.supervisor.events if e.server == 0]
    assert [e.kind for e in events] == ["down", "restart", "up"], events
    assert "process exited" in events[0].detail or "GET /health" in events[0].detail
    up = events[-1].at
    restored = seen["restored"]
    after = [versions for at, versions in seen["completions"] if at > up and versions]
    assert after, "no completion was answered by the restarted server"
    assert all(min(v) >= restored for v in after), (restored, after)
    return restored, up - events[0].at


@pytest.mark.integration
def test_fully_async_vllm_in_flight_recompute_labels_every_token(
    tmp_path, vllm_python, served_weights, killed_after_first_switch, monkeypatch
):
    c = _shrink(vllm_local.get_config())
    c.engine.in_flight_updates = "recompute"
    c.engine.supervisor.health_interval_s = 1.0
    seen = killed_after_first_switch
    restore = engines_mod.EngineSet._supervise

    def supervise(self, client, model):  # the version the restore labels the server with
        restore(self, client, model)
        relabel = client.relabel

        async def recorded(target, version):
            seen["restored"] = version
            await relabel(target, version)

        client.relabel = recorded

    monkeypatch.setattr(engines_mod.EngineSet, "_supervise", supervise)
    t = Trainer(c, tmp_path)
    start = time.monotonic()
    history = t.run()
    took = time.monotonic() - start
    _check_rows(history)
    restored, outage = _check_restored(t.parts.engines.policy, seen)
    records = _records(tmp_path)
    assert sorted(records) == list(range(1, NUM_STEPS + 1))
    # every version a step trained reached the server (the last one may be cut short by the close)
    assert set(range(NUM_STEPS)) <= set(served_weights)
    checked, worst = _check_labels(records, served_weights, c.rollout.temperature)
    crossed = sum(len(r["weight_versions"]) > 1 for rows in records.values() for r in rows)
    # Each version whose switch fell inside a completion was switched to while its group ran, so it
    # is counted in async/inflight_updates (not the converse: a switch can fall between two turns).
    crossing = {s["version"] for rows in records.values() for r in rows for s in r["weight_versions"][1:]}
    updates = sum(h["async/inflight_updates"] for h in history)
    assert len(crossing) <= updates <= NUM_STEPS - 1, (crossing, updates)  # rows see v1..v(N-1)
    per_row = [h["async/inflight_updates"] for h in history]
    print(
        f"\nrecompute: tokens checked per version {dict(checked)} (max |vLLM - trainer| {worst:.2g}); "
        "completions crossed by a switch: "
        f"{crossed} (switches to {sorted(crossing)}); async/inflight_updates per row {per_row}; "
        f"rl/mismatch_kl per row {[round(h['rl/mismatch_kl'], 8) for h in history]}; server killed "
        f"holding {seen['kill']} requests, back restored as v{restored} after {outage:.0f} s; "
        f"run {took:.0f} s"
    )


@pytest.mark.integration
def test_fully_async_vllm_lora_adapter_sync_one_adapter_per_turn(tmp_path, vllm_python, served_weights):
    c = lora_vllm.get_config()
    small = _shrink(vllm_local.get_config())
    for key in ("warmstart", "envs", "rollout", "trainer"):
        c[key] = small[key]
    c.engine.server.extra_args = small.engine.server.extra_args
    t = Trainer(c, tmp_path)
    history = t.run()
    _check_rows(history)
    assert set(range(NUM_STEPS)) <= set(served_weights)
    names = {f"rljax-lora-v{v}" for v in (NUM_STEPS - 1, NUM_STEPS)}
    assert t.parts.engines.policy.lora_name in names  # adapters were swapped while the stream ran
    records = _records(tmp_path)
    for rows in records.values():
        for r in rows:  # a request keeps the adapter it names: one version per turn
            assert len(r["weight_versions"]) <= 1, r["weight_versions"]
    checked, worst = _check_labels(records, served_weights, c.rollout.temperature)
    assert len(checked) > 1, f"every token was sampled by one adapter version: {dict(checked)}"
    print(
        f"\nadapter sync: tokens checked per adapter version {dict(checked)}, "
        f"max |vLLM - trainer| {worst:.2g}"
    )


# -- quick checks (no server) ---------------------------------------------------------------------------


def test_in_flight_updates_with_lora_adapter_sync_are_refused_naming_the_alternatives():
    c = lora_vllm.get_config()
    c.engine.in_flight_updates = "recompute"
    with pytest.raises(
        ValueError, match=r"in_flight_updates='off' with lora_sync='adapter'.*lora_sync='merged'"
    ):
        parse_run_config(c)
    c.engine.lora_sync = "merged"  # full merged weights: switched in flight like any full-weight sync
    assert parse_run_config(c).engine.in_flight_updates == "recompute"
    c.engine.update(lora_sync="adapter", in_flight_updates="off")
    assert parse_run_config(c).engine.lora_sync == "adapter"


def _generate_server(spans: list[tuple[str, int, int]]) -> httpx.MockTransport:
    """A ``/inference/v1/generate`` that answers 3 tokens with vLLM's weight-version ``spans``
    (``(label, start, end)``)."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == GENERATE_PATH
        content = [{"token_id": t, "logprob": -0.5} for t in (7, 8, 9)]
        raw = [{"version": v, "start": i, "end": j} for v, i, j in spans]
        choice = {"token_ids": [7, 8, 9], "finish_reason": "length", "logprobs": {"content": content}}
        return httpx.Response(200, json={"choices": [{**choice, "weight_versions": raw}]})

    return httpx.MockTransport(handler)


def test_an_adapter_request_is_labelled_with_the_adapter_it_named():
    """vLLM's span labels follow the base weights (never relabelled by an adapter sync: "default"
    throughout); a request naming the adapter of version 5 is v5's, every token."""

    async def main():
        crossed = _generate_server([("default", 0, 1), ("1", 1, 3)])  # a base switch fell inside
        async with InFlightVLLMClient(["http://s:1"], transport=crossed) as base:
            plain = await base.generate([1, 2], SamplingParams(max_tokens=3))
        async with InFlightVLLMClient(["http://s:1"], transport=_generate_server([("default", 0, 3)])) as c:
            c.lora_name, c.weight_version = "m-lora-v5", 5  # what an adapter sync sets
            adapter = await c.generate([1, 2], SamplingParams(max_tokens=3))
            other = await c.generate([1, 2], SamplingParams(max_tokens=3), model="m-lora-v4")
        return plain, adapter, other

    plain, adapter, other = asyncio.run(main())
    assert plain.token_versions() == [0, 1, 1]  # full weights: vLLM's own spans
    assert adapter.token_versions() == [5, 5, 5] and adapter.weight_version == 5
    assert other.token_versions() == [5, 5, 5]  # as VLLMClient: the version when the request was built
