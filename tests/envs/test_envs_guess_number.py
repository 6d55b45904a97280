"""The guessing game (rljax.envs.guess_number): tasks, feedback, rewards, binary search's demonstrations."""

import math

import numpy as np
import pytest

from rljax.envs import GuessNumberEnv, Task, make_env, make_guess_tasks
from rljax.envs.guess_number import binary_search_guesses


def game(n=23, number=17):
    return Task("g", {"n": n, "number": number, "max_guesses": n.bit_length()}, env="guess_number")


def test_tasks_are_every_game_once_split_and_seeded():
    train = make_guess_tasks(10_000, seed=0)
    test = make_guess_tasks(10_000, seed=0, split="test")
    games = {(t.data["n"], t.data["number"]) for t in train + test}
    assert games == {(n, k) for n in range(10, 31) for k in range(1, n + 1)} and len(train) + len(test) == 420
    assert not {t.id for t in train} & {t.id for t in test} and 0.1 < len(test) / 420 < 0.3
    # max_guesses: what binary search needs, ceil(log2(n + 1)) (n.bit_length() is the same number)
    assert all(t.data["max_guesses"] == math.ceil(math.log2(t.data["n"] + 1)) for t in train)
    assert [t.id for t in make_guess_tasks(4, seed=3)] == [t.id for t in make_guess_tasks(4, seed=3)]
    assert make_guess_tasks(5, seed=0, n_range=(4, 4), extra_guesses=2)[0].data["max_guesses"] == 5


def test_a_game_by_hand():
    env = make_env("guess_number")
    assert env.reset(game())[0]["content"] == (
        "I am thinking of a number between 1 and 23. Guess it: reply with one number. After each guess "
        "I tell you whether my number is higher or lower. You have 5 guesses."
    )
    assert env.step("12")[:3] == ([{"role": "user", "content": "My number is higher than 12."}], 0.0, False)
    assert env.step("Maybe 20? or 19")[0] == [{"role": "user", "content": "My number is lower than 20."}]
    assert env.step("no idea")[0] == [{"role": "user", "content": "Reply with one number between 1 and 23."}]
    _, reward, done, info = env.step("17")
    assert (reward, done, info["correct"], info["guesses"]) == (1.0, True, True, 4)


def test_running_out_of_guesses_or_a_truncated_turn_loses():
    from rljax.envs import Action

    env = GuessNumberEnv()
    env.reset(game(n=10, number=3))  # 4 guesses
    for g in ("5", "1", "9"):
        assert not env.step(g)[2]
    _, reward, done, info = env.step("2")
    assert (reward, done, info["correct"]) == (0.0, True, False)
    env.reset(game(n=10, number=3))
    _, reward, done, _ = env.step(Action("5 is my gue", stopped=False))
    assert (reward, done) == (0.0, True)
    with pytest.raises(ValueError, match="after the game ended"):
        env.step("3")


def test_binary_search_wins_every_game_and_its_demonstrations_replay():
    for n in range(10, 31):
        for number in range(1, n + 1):
            guesses = binary_search_guesses(n, number)
            assert guesses[-1] == number and len(guesses) <= n.bit_length()
            env = GuessNumberEnv()
            t = game(n, number)
            env.reset(t)
            solution = GuessNumberEnv.solution(t)
            assert [m["content"] for m in solution if m["role"] == "assistant"] == [str(g) for g in guesses]
            for m in solution:  # the env's replies are the demonstration's user turns
                if m["role"] == "assistant":
                    new, reward, done, _ = env.step(m["content"])
                else:
                    assert new == [m]
            assert (reward, done) == (1.0, True)


def test_a_player_who_ignores_the_replies_wins_about_max_guesses_over_n():
    rng = np.random.default_rng(0)
    tasks = make_guess_tasks(10_000, seed=0)
    wins = []
    for t in tasks:
        env = GuessNumberEnv()
        env.reset(t)
        for g in rng.permutation(t.data["n"])[: t.data["max_guesses"]] + 1:
            _, reward, done, _ = env.step(str(g))
            if done:
                break
        wins.append(reward)
    expected = np.mean([t.data["max_guesses"] / t.data["n"] for t in tasks])
    assert abs(np.mean(wins) - expected) < 0.06 and 0.2 < expected < 0.3
