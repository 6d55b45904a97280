"""The suite's XLA settings (tests/xla_flags.py): the real-model tests' per-compilation override."""

import jax
import jax.numpy as jnp
from jax._src import compiler
from xla_flags import XLA_DEFAULT_OPTIONS, optimized_compilation


def _overrides() -> dict:
    return dict(compiler.get_compile_options(num_replicas=1, num_partitions=1).env_option_overrides)


def test_optimized_compilation_overrides_fast_compile_inside_only() -> None:
    assert _overrides() == {}
    with optimized_compilation():
        assert _overrides() == XLA_DEFAULT_OPTIONS
        # a caller's own option wins; the program compiles and runs under the overrides
        mine = compiler.get_compile_options(
            num_replicas=1, num_partitions=1, env_options_overrides={"xla_backend_optimization_level": 1}
        )
        assert dict(mine.env_option_overrides)["xla_backend_optimization_level"] == 1
        assert float(jax.jit(lambda x: jnp.sum(jnp.exp(x)))(jnp.zeros(3))) == 3.0
    assert _overrides() == {}
