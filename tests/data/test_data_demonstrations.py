"""opsd: demonstration-conditioned sequences, response slicing, and the end-to-end slicing check.

References: hand-built lists, and for the model check an unpacked forward
(``sequence_logprobs``) of the conditioned sequence rendered independently by the renderer
(``[system(demonstration)] + messages``), sliced by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.chat import ChatMLRenderer, Llama3Renderer, toy_tokenizer
from rljax.chat.base import DEFAULT_DEMONSTRATION_TEMPLATE, DemonstrationHint
from rljax.data.demonstrations import condition_on_demonstration, slice_response
from rljax.inference.scoring import score_sequences

# -- host functions ---------------------------------------------------------------------------


def test_condition_by_hand():
    hint = DemonstrationHint(1, (90, 91, 92), prefix=(0,))
    assert condition_on_demonstration([0, 5, 6], [7, 8], hint) == ([0, 90, 91, 92, 5, 6, 7, 8], 6)
    assert condition_on_demonstration([3, 4], [5], DemonstrationHint(0, (9,))) == ([9, 3, 4, 5], 3)
    assert condition_on_demonstration([3, 4], [5], DemonstrationHint(2, (9,))) == ([3, 4, 9, 5], 3)
    assert condition_on_demonstration([3, 4], [], DemonstrationHint(0, (9,))) == ([9, 3, 4], 3)
    assert condition_on_demonstration(np.array([3, 4]), (5, 6), DemonstrationHint(0, ())) == ([3, 4, 5, 6], 2)


def test_condition_errors():
    with pytest.raises(ValueError, match="prompt has 2"):
        condition_on_demonstration([3, 4], [5], DemonstrationHint(3, (9,)))
    with pytest.raises(ValueError, match="different chat formats"):
        condition_on_demonstration([3, 4], [5], DemonstrationHint(1, (9,), prefix=(0,)))
    # an empty hint inserts nothing, so nothing is checked
    assert condition_on_demonstration([3], [5], DemonstrationHint(0, ())) == ([3, 5], 1)


ids = st.lists(st.integers(0, 1000), max_size=12)


@settings(max_examples=60, deadline=None)
@given(prompt=ids, response=ids, hint_ids=ids, data=st.data())
def test_property_conditioned_layout(prompt, response, hint_ids, data):
    k = data.draw(st.integers(0, len(prompt)))
    hint = DemonstrationHint(k, tuple(hint_ids), prefix=tuple(prompt[:k]))
    out, start = condition_on_demonstration(prompt, response, hint)
    assert len(out) == len(prompt) + len(hint_ids) + len(response)
    assert out[start:] == response
    assert out[k : k + len(hint_ids)] == hint_ids
    assert out[:k] + out[k + len(hint_ids) : start] == prompt
    scores = np.arange(len(out), dtype=np.float32)
    assert slice_response(scores, start, len(response)).tolist() == list(range(start, len(out)))


def test_slice_response_by_hand_and_errors():
    s = np.array([0.0, -1.0, -2.0, -3.0], np.float32)
    assert slice_response(s, 1, 3).tolist() == [-1.0, -2.0, -3.0]
    assert slice_response(s, 4, 0).tolist() == []
    out = slice_response(s, 0, 2)
    out[0] = 5.0
    assert s[0] == 0.0  # a copy, not a view
    with pytest.raises(ValueError, match="outside"):
        slice_response(s, 2, 3)
    with pytest.raises(ValueError, match="outside"):
        slice_response(s, -1, 1)
    with pytest.raises(ValueError, match="1-D"):
        slice_response(s[None], 0, 1)


# -- the opsd slicing check with a model ------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 3 + 4?"},
]
DEMO = "3 + 4: count four up from three: 4, 5, 6, 7. The answer is 7."


@pytest.fixture(scope="module")
def model():
    """A tiny Llama-style decoder over the toy vocabularies, weights re-drawn at visible scales."""
    cfg = models.tiny_config("llama", vocab_size=272)
    graphdef, state = nnx.split(models.Decoder(cfg, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def unpacked(model, seq):
    return np.asarray(models.sequence_logprobs(model, jnp.asarray(seq, jnp.int32)[None])[0], np.float64)


@pytest.mark.parametrize(
    "renderer",
    [ChatMLRenderer(toy_tokenizer("chatml")), Llama3Renderer(toy_tokenizer("llama3"), system_preamble=False)],
    ids=["chatml", "llama3"],
)
def test_opsd_scores_slice_back_to_the_response(model, renderer):
    prompt = renderer.render_ids(MESSAGES, add_generation_prompt=True)
    response = renderer.tokenizer.encode("It is 7.", add_special_tokens=False) + renderer.stop_token_ids()[:1]
    n = len(response)
    empty = renderer.demonstration_hint(None)
    hint = renderer.demonstration_hint(DEMO)

    plain_seq, plain_start = condition_on_demonstration(prompt, response, empty)
    cond_seq, cond_start = condition_on_demonstration(prompt, response, hint)
    # Several samples in one packed call (the trainer scores a whole batch at once).
    plain_scores, cond_scores, _ = score_sequences(model, [plain_seq, cond_seq, prompt + response])
    plain = slice_response(plain_scores, plain_start, n)
    cond = slice_response(cond_scores, cond_start, n)

    # Empty hint: the sample itself, so exactly the plain prefill's response logprobs (bitwise when
    # scored at the same place; within float noise when packed elsewhere or run unpacked).
    assert plain_seq == prompt + response and plain_start == len(prompt)
    (alone_plain,) = score_sequences(model, [prompt + response])
    (alone_cond,) = score_sequences(model, [plain_seq])
    np.testing.assert_array_equal(slice_response(alone_cond, plain_start, n), alone_plain[len(prompt) :])
    np.testing.assert_allclose(plain, unpacked(model, prompt + response)[len(prompt) :], **LOGPROB_TOL)

    # Non-empty hint: the renderer's own render with the demonstration system message, plus the
    # response, run unpacked and sliced by hand.
    text = DEFAULT_DEMONSTRATION_TEMPLATE.replace("{demonstration}", DEMO)
    by_hand = renderer.render_ids(
        [{"role": "system", "content": text}, *MESSAGES], add_generation_prompt=True
    )
    assert cond_seq == by_hand + response
    ref = unpacked(model, by_hand + response)[len(by_hand) :]
    assert cond.shape == (n,) and ref.shape == (n,)
    np.testing.assert_allclose(cond, ref, **LOGPROB_TOL)

    # The demonstration changes the teacher's log-probabilities.
    assert np.max(np.abs(cond - plain)) > 1e-2
