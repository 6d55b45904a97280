"""Float tolerances shared by the tests, derived from measured float32 noise (with a margin).

Two float32 programs that compute the same log-probabilities in a different order (packed vs
alone, blocked vs dense attention, KV-cache decode vs one forward, another XLA fusion on another
CPU) differ by rounding that grows with the magnitude of the value: on this project's 2-core AVX2
machines we measured up to 1.24e-5 at |logp| = 7.1 (1.7e-6 relative) between a packed and an
unpacked forward of a tiny Llama, and up to ~3e-6 at |logp| < 2. ``LOGPROB_TOL`` allows
1e-5 + 1e-5 * |logp| (8e-5 at |logp| = 7: >= 5x the largest drift seen), still ~1000x below a
real error such as a shifted position, a wrong mask or a missed temperature (>= 1e-2 in these
tests). Use it for comparisons of two float32 computations of log-probabilities; keep tighter
bounds where a test compares bit-identical programs.

And what two runs that train alike never share: the metrics that measure the machine.
"""

#: ``np.testing.assert_allclose(actual, desired, **LOGPROB_TOL)`` for float32 log-probabilities.
LOGPROB_TOL = dict(atol=1e-5, rtol=1e-5)

#: Prefixes of metric keys that measure the machine, not the run (seconds, rates, the process's
#: resident memory): tests that compare two runs' rows leave these keys out.
MEASURED_METRIC_PREFIXES = ("time", "throughput", "memory/host_")

#: Engine settings under which a run does not depend on timing, for tests that compare two runs bit
#: for bit. The embedded sampler batches the requests that arrive within ``engine.batch_wait_ms`` of
#: each other, so which requests share a batch follows the machine's load (eval beside the next
#: step's rollouts, one trajectory's turn a moment later than another's); a batch of another shape
#: computes a row's logprobs in another order (measured: ~1e-7 apart, which moves ``rl/mismatch_kl``
#: at 4e-14 and, where the loss reads the sampler's logprobs as ``dppo`` does, the loss and the
#: parameters in their last bits), though it samples the same tokens. One request per batch takes
#: timing out.
TIMING_INDEPENDENT_ENGINE = dict(max_batch_size=1, min_batch_bucket=1)
#: :data:`TIMING_INDEPENDENT_ENGINE` as ``rljax train`` flags.
TIMING_INDEPENDENT_ENGINE_FLAGS = tuple(
    f"--config.engine.{k}={v}" for k, v in TIMING_INDEPENDENT_ENGINE.items()
)
