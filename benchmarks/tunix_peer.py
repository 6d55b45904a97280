"""Google Tunix as a benchmark peer: the same Qwen3 model and workloads, timed inside Tunix.

Two halves in one file:

* the **peer** (``python benchmarks/tunix_peer.py --spec SPEC.json``), run with the python of the
  Tunix virtual environment (``.ci/install_tunix.sh`` makes ``.tunix-venv`` with
  ``google-tunix==0.1.7`` and the same jax / flax / optax versions as rljax's). It never imports
  rljax. It loads the checkpoint that the rljax side wrote with :func:`rljax.models.save_pretrained`
  into Tunix's own Qwen3 (``tunix.models.qwen3.params.create_model_from_safe_tensors``), so both
  libraries run the same weights, checks that Tunix's per-token logprobs of a reference sequence
  match rljax's, compiles, prints one ``{"ready": ...}`` JSON line, then answers one command per
  stdin line (``generate`` / ``update`` / ``quit``) with one JSON line ``{"tokens": N, "seconds": s}``
  for one timed pass. Staying alive between commands lets the caller interleave rljax and Tunix
  passes (A, B, A, B, ...) on a noisy shared machine with both programs compiled and warm.
* the **client** (:class:`TunixPeer`, standard library only), which the rljax benchmarks
  (``generation_bench.py --tunix``, ``train_step_bench.py --tunix``) use to start and drive the peer.

What the peer runs is what Tunix users run:

* generation: ``tunix.generate.sampler.Sampler.__call__`` (the vanilla sampler behind Tunix's
  GRPO rollouts): host-side prompt handling, one jitted prefill, one jitted ``lax.while_loop`` over
  the new tokens, ``device_get`` and per-row slicing. ``temperature=T, top_p=1.0`` selects its
  ``top_p`` mode, which for ``top_p >= 1`` and no top-k draws with ``jax.random.categorical`` on
  ``logits / T``; ``return_logprobs=True`` also records each drawn token's logprob. Prompts are token
  ids (a pass-through tokenizer: a prompt string is its space-separated ids), all of the same
  length (no padding); the eos id is -1 so every row generates exactly ``max_tokens`` tokens, and
  the pad id is -1 too (Tunix masks cache slots whose token equals the pad id, which must never hit
  a real token).
* update: the jitted train step of ``tunix.rl.trainer.Trainer`` (the actor trainer of Tunix's
  ``GRPOLearner``: ``PeftTrainer._train_step`` = ``nnx.value_and_grad`` of the loss, global grad
  norm, ``nnx.Optimizer.update``) with the loss ``GRPOLearner`` installs: the registered ``grpo``
  policy loss (``tunix.rl.algo_core.grpo_loss_fn``: completion logprobs from the full-vocabulary
  logits, PPO-clip surrogate, ``sequence-mean-token-mean`` aggregation), ``beta=0`` (no reference
  KL), ``num_iterations=1``. The optimizer is ``optax.chain(clip_by_global_norm, adamw)`` as in
  Tunix's GRPO examples. A ``TrainExample`` of ``rows`` prompts of ``prompt_len`` tokens and
  completions of ``completion_len`` tokens (no padding), one advantage per row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "TunixPeer",
    "TunixUnavailable",
    "describe_ready",
    "find_tunix_python",
    "load_average",
    "model_spec",
    "summary",
]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------
# client (rljax side; standard library only)
# ------------------------------------------------------------------------------------------------


class TunixUnavailable(RuntimeError):
    """Tunix is not installed (or its peer failed to start); the message says what to do."""


def find_tunix_python() -> str | None:
    """``$RLJAX_TUNIX_PYTHON`` or ``<repo>/.tunix-venv/bin/python``; None when neither exists."""
    explicit = os.environ.get("RLJAX_TUNIX_PYTHON")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    default = os.path.join(_REPO, ".tunix-venv", "bin", "python")
    return default if os.path.exists(default) else None


def model_spec(config: Any) -> dict[str, Any]:
    """The ``model`` entry of a peer spec from an rljax :class:`rljax.models.ModelConfig` (Qwen3 only)."""
    if config.model_type != "qwen3" or not config.qk_norm or config.is_moe:
        raise ValueError(f"the Tunix peer runs dense Qwen3 models; got model_type {config.model_type!r}")
    keys = ("num_layers", "vocab_size", "hidden_size", "intermediate_size", "num_heads", "head_dim",
            "num_kv_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings")  # fmt: skip
    return {k: getattr(config, k) for k in keys}


def load_average() -> str:
    """The 1/5/15-minute load averages (``/proc/loadavg``), printed beside every figure."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def describe_ready(ready: dict[str, Any]) -> str:
    """One line on the started peer: versions, start-up time and the same-weights logprob check."""
    versions = " ".join(f"{k} {v}" for k, v in ready["versions"].items())
    line = f"ready after {ready['startup_s']} s ({versions})"
    diff = ready.get("max_abs_logprob_diff")
    if diff is None:
        return line
    line += f"; same weights: max |logprob Tunix - rljax| {diff:.2e}"
    if diff > 1e-3:
        line += (
            " -- WARNING: the two models disagree (Tunix 0.1.7's Qwen3 applies RoPE with theta 1e6 "
            "whatever rope_theta says); the timed work is the same"
        )
    return line


def summary(rates: Sequence[float]) -> str:
    """``best X, median Y (passes: a, b, ...)`` of tokens/s figures."""
    median = statistics.median(rates)
    passes = ", ".join(f"{r:,.0f}" for r in rates)
    return f"best {max(rates):,.0f}, median {median:,.0f} tokens/s (passes: {passes})"


def report(
    ours: Sequence[float], theirs: Sequence[float], *, labels: tuple[str, str], goal: float
) -> dict[str, float]:
    """Prints both sides' :func:`summary` and the rljax / Tunix ratio (best and median) against
    ``goal``; returns the figures."""
    ratio = max(ours) / max(theirs)
    ratio_median = statistics.median(ours) / statistics.median(theirs)
    verdict = "PASS" if ratio >= goal else "FAIL"
    width = max(len(x) for x in labels) + 1
    print(f"  {labels[0] + ':':<{width}} {summary(ours)}")
    print(f"  {labels[1] + ':':<{width}} {summary(theirs)}")
    print(f"  ratio rljax/tunix: {ratio:.2f}x best, {ratio_median:.2f}x median (goal >= {goal:.1f}x: "
          f"{verdict}) [load average {load_average()}]", flush=True)  # fmt: skip
    return {"rljax": max(ours), "tunix": max(theirs), "ratio": ratio, "ratio_median": ratio_median}


class TunixPeer:
    """The Tunix peer process (this file under the Tunix venv's python), driven one pass at a time.

    >>> # with TunixPeer(spec) as peer:          # spec: see the module docstring of tunix_peer.py
    >>> #     tokens, seconds = peer.run("generate")

    Args:
      spec: the JSON-serializable workload (``checkpoint``, ``model``, ``generate`` and/or
        ``update``, optional ``check``), written to a temporary file for the peer.
      python: the Tunix venv's python (default :func:`find_tunix_python`).
      startup_timeout_s: seconds to wait for the peer's ``ready`` line (loading + compiling).
    """

    def __init__(self, spec: dict[str, Any], *, python: str | None = None,
                 startup_timeout_s: float = 1800.0) -> None:  # fmt: skip
        self.spec = spec
        self.python = python or find_tunix_python()
        self.startup_timeout_s = startup_timeout_s
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> TunixPeer:
        if self.python is None:
            raise TunixUnavailable(
                "Tunix is not installed: run .ci/install_tunix.sh (creates .tunix-venv) or set "
                "RLJAX_TUNIX_PYTHON"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="tunix_peer_")
        spec_path = os.path.join(self._dir.name, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(self.spec, f)
        self._log = open(os.path.join(self._dir.name, "stderr.log"), "w+")  # noqa: SIM115 (closed in __exit__)
        self._proc = subprocess.Popen(
            [self.python, os.path.abspath(__file__), "--spec", spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self.ready = self._read(self.startup_timeout_s)
        if "ready" not in self.ready:
            raise TunixUnavailable(f"the Tunix peer did not start: {self.ready}")
        return self

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line:  # the peer exited
                self._proc.wait()
                self._log.seek(0)
                tail = self._log.read()[-4000:]
                raise TunixUnavailable(f"the Tunix peer exited with {self._proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TunixUnavailable(f"the Tunix peer gave no answer within {timeout_s:.0f} s")

    def run(self, task: str, *, timeout_s: float = 1800.0) -> tuple[int, float]:
        """One timed pass of ``task`` ("generate" or "update") in the peer: (tokens, seconds)."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(task + "\n")
        self._proc.stdin.flush()
        answer = self._read(timeout_s)
        if "error" in answer:
            raise RuntimeError(f"the Tunix peer failed on {task!r}: {answer['error']}")
        return int(answer["tokens"]), float(answer["seconds"])

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            try:
                if self._proc.poll() is None:
                    assert self._proc.stdin is not None
                    self._proc.stdin.write("quit\n")
                    self._proc.stdin.flush()
                    self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
        if self._dir is not None:
            self._dir.cleanup()


# ------------------------------------------------------------------------------------------------
# peer (Tunix venv side)
# ------------------------------------------------------------------------------------------------


class _IdTokenizer:
    """Pass-through tokenizer for Tunix's sampler: a prompt string is its space-separated token ids."""

    def __init__(self, pad_id: int, eos_id: int) -> None:
        self._pad, self._eos = pad_id, eos_id

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self) -> None:  # no BOS is prepended
        return None

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


def _tunix_model(spec: dict[str, Any]) -> Any:
    """Tunix's Qwen3 from the rljax checkpoint (same weights), float32."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    m = spec["model"]
    config = qwen3_model.ModelConfig(
        num_layers=m["num_layers"],
        vocab_size=m["vocab_size"],
        embed_dim=m["hidden_size"],
        hidden_dim=m["intermediate_size"],
        num_heads=m["num_heads"],
        head_dim=m["head_dim"],
        num_kv_heads=m["num_kv_heads"],
        rope_theta=int(m["rope_theta"]),
        norm_eps=m["rms_norm_eps"],
        use_tied_embedding=m["tie_word_embeddings"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    return qwen3_params.create_model_from_safe_tensors(spec["checkpoint"], config, dtype=jnp.float32)


def _check_logprobs(model: Any, check: dict[str, Any]) -> float:
    """Max |Tunix - rljax| per-token logprob of the reference sequence (same weights, float32)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.rl import common

    tokens = jnp.asarray([check["tokens"]], jnp.int32)
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(
        graphdef, state, prompt_tokens=tokens[:, :1], completion_tokens=tokens[:, 1:], pad_id=-1, eos_id=-1
    )
    return float(np.max(np.abs(np.asarray(logps)[0] - np.asarray(check["logprobs"][1:], np.float32))))


class _Generate:
    """One pass = ``Sampler(prompts, max_tokens, temperature, top_p=1, return_logprobs=True)``."""

    def __init__(self, model: Any, spec: dict[str, Any]) -> None:
        from tunix.generate import sampler as sampler_lib

        g = spec["generate"]
        self.prompts = [" ".join(str(t) for t in p) for p in g["prompts"]]
        self.prompt_len = max(len(p) for p in g["prompts"])
        self.max_tokens = int(g["max_tokens"])
        self.temperature = float(g["temperature"])
        self.seed = int(g.get("seed", 0))
        m = spec["model"]
        cache = sampler_lib.CacheConfig(
            cache_size=self.prompt_len + self.max_tokens,
            num_layers=m["num_layers"],
            num_kv_heads=m["num_kv_heads"],
            head_dim=m["head_dim"],
        )
        self.sampler = sampler_lib.Sampler(model, _IdTokenizer(pad_id=-1, eos_id=-1), cache)
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        out = self.sampler(
            self.prompts,
            max_generation_steps=self.max_tokens,
            max_prompt_length=self.prompt_len,
            temperature=self.temperature,
            top_p=1.0,
            return_logprobs=True,
            eos_tokens=[-1],
            seed=self.seed + self.calls,
        )
        lengths = [len(t) for t in out.tokens] + [len(lp) for lp in out.logprobs]
        if any(n != self.max_tokens for n in lengths):
            raise RuntimeError(
                f"Tunix returned {sorted(set(lengths))} tokens / logprobs per row, not {self.max_tokens}"
            )
        return len(out.tokens) * self.max_tokens


class _Update:
    """One pass = one jitted ``tunix.rl.trainer.Trainer`` step with the GRPO loss on a fixed batch."""

    def __init__(self, model: Any, spec: dict[str, Any]) -> None:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import nnx
        from tunix.rl import function_registry
        from tunix.rl import trainer as rl_trainer
        from tunix.rl.grpo import grpo_learner
        from tunix.sft import peft_trainer

        u = spec["update"]
        rows, plen, clen = int(u["rows"]), int(u["prompt_len"]), int(u["completion_len"])
        rng = np.random.default_rng(int(u.get("seed", 0)))
        vocab = spec["model"]["vocab_size"]
        algo = grpo_learner.GRPOConfig(num_generations=int(u.get("group_size", 4)), beta=0.0, epsilon=0.2)
        algo.temperature = 1.0  # what GRPOLearner sets from the rollout config
        policy_loss = function_registry.get_policy_loss_fn(algo.policy_loss_fn)

        def loss_fn(model: Any, train_example: Any, algo_config: Any) -> Any:  # as GRPOLearner installs it
            return policy_loss(model, train_example, algo_config=algo, pad_id=-1, eos_id=-1)

        optimizer = optax.chain(
            optax.clip_by_global_norm(float(u.get("max_grad_norm", 1.0))),
            optax.adamw(float(u.get("learning_rate", 1e-6)), weight_decay=float(u.get("weight_decay", 0.01))),
        )
        self.trainer = rl_trainer.Trainer(
            model,
            optimizer,
            peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9),
            custom_checkpoint_metadata_fn=dict,
        )
        self.trainer.with_loss_fn(loss_fn, has_aux=True)
        self.trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
        self.step, _ = self.trainer.jit_train_and_eval_step()
        self.example = grpo_learner.TrainExample(
            prompt_ids=jnp.asarray(rng.integers(0, vocab, (rows, plen)), jnp.int32),
            prompt_mask=jnp.ones((rows, plen), jnp.int32),
            completion_ids=jnp.asarray(rng.integers(0, vocab, (rows, clen)), jnp.int32),
            completion_mask=jnp.ones((rows, clen), jnp.int32),
            advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
            ref_per_token_logps=None,
            old_per_token_logps=None,
        )
        self.tokens = rows * (plen + clen)
        self._jax = jax
        self._nnx = nnx

    def __call__(self) -> int:
        loss, aux, grad_norm = self.step(self.example)
        self._jax.block_until_ready((loss, aux, grad_norm, self._nnx.state(self.trainer.model)))
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"the Tunix step gave a non-finite loss {float(loss)}")
        return self.tokens


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")}


def serve(spec_path: str) -> int:
    """The peer: load, check, compile, then one timed pass per stdin command (module docstring)."""
    import jax

    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    model = _tunix_model(spec)
    ready: dict[str, Any] = {"ready": True, "versions": _versions(), "device": jax.devices()[0].device_kind}
    if spec.get("check"):
        ready["max_abs_logprob_diff"] = _check_logprobs(model, spec["check"])
    tasks: dict[str, Any] = {}
    if spec.get("generate"):
        tasks["generate"] = _Generate(model, spec)
    if spec.get("update"):
        tasks["update"] = _Update(model, spec)
    # Compile and warm up before the caller's timed passes: two untimed calls each (with one, the first
    # timed Tunix trainer step of a trial run took ~10x the next ones).
    for task in tasks.values():
        task()
        task()

    ready["startup_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command not in tasks:
            error = f"unknown command {command!r}; have {sorted(tasks)} and quit"
            print(json.dumps({"error": error}), flush=True)
            continue
        try:
            start = time.perf_counter()
            tokens = tasks[command]()
            seconds = time.perf_counter() - start
        except Exception as e:  # reported to the caller, which raises it
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the workload JSON written by the rljax benchmark")
    args = parser.parse_args(argv)
    return serve(args.spec)


if __name__ == "__main__":
    raise SystemExit(main())
