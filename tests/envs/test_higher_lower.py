"""examples/higher_lower: the game's rules and reward worked by hand (plain Python, always run), then the game as a
verifiers environment (skipped without the optional verifiers): its tasks as rows, its episodes against the tiny
model scored as the rules say, and its example command training two steps and resuming exactly."""

import ast
import importlib.util
import json
import shlex
from pathlib import Path

import pytest

import covey
from covey.config import load_config
from examples.higher_lower.higher_lower_game import Game, read_guess
from tests.helpers import resumed_step_two, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
TARGET = "examples/higher_lower/higher_lower.py"
PROMPT = "Guess my number from 1 to 9. Answer with one digit."


@pytest.mark.parametrize("reply, guess", [
    ("5", 5), ("I guess 7.", 7), ("10", None), ("0", None), ("no idea", None),
    ("12 or 3", None),  # the first whole number is the guess: 12 is outside 1..9
    ("1 to 9: 4", 1),
])
def test_a_reply_s_guess_is_its_first_whole_number_within_range(reply, guess):
    assert read_guess(reply, 9) == guess


def test_a_lost_game_scores_half_the_closeness_of_its_last_guess():
    game = Game(secret=6)
    assert game.prompt() == PROMPT
    assert game.step("5") == "No, higher. Guess again."
    assert game.step("It is 9") == "No, lower. Guess again."
    assert game.step("six") == "Answer with one digit from 1 to 9."
    assert game.step("7") is None and game.over and not game.found  # the fourth and last try
    # last guess 7, secret 6: closeness 1 - |7 - 6| / (9 - 1) = 0.875; reward 0.5 * 0.875 = 0.4375
    assert game.reward() == 0.4375
    # 3 of 4 replies held a guess; the only pair of consecutive guesses is (5, 9): 5 < 6 was answered
    # "higher" and 9 > 5 went that way ((9, None) and (None, 7) are not pairs): followed 1/1
    assert game.metrics() == {"found": 0.0, "turns": 4.0, "closeness": 0.875, "valid": 0.75, "followed": 1.0}
    with pytest.raises(ValueError, match="the game is over"):
        game.step("6")


def test_a_found_secret_scores_1_and_ends_the_game():
    game = Game(secret=2)
    assert game.step("5") == "No, lower. Guess again."
    assert game.step("7") == "No, lower. Guess again."  # up after "lower": against the answer
    assert game.step("1") == "No, higher. Guess again."  # down after "lower" (7 > 2): with it
    assert game.step("2") is None and game.found and game.reward() == 1.0
    # pairs (5, 7) against, (7, 1) with, (1, 2) with ("higher" after 1 < 2): followed 2/3
    assert game.metrics()["followed"] == pytest.approx(2 / 3)
    assert Game(secret=3, tries=1).step("3") is None  # found on the one try


def test_no_guess_at_all_scores_0():
    game = Game(secret=4, tries=2)
    assert game.step("hello") == "Answer with one digit from 1 to 9." and game.step("?") is None
    assert game.reward() == 0.0 and game.metrics() == {"found": 0.0, "turns": 2.0, "closeness": 0.0, "valid": 0.0}


def test_reading_the_answers_is_what_earns_the_most():
    def constant(secret: int) -> float:
        game = Game(secret)
        while game.step("5") is not None:
            pass
        return game.reward()

    def halving(secret: int) -> float:
        game, low, high = Game(secret), 1, 9
        while True:
            guess = (low + high) // 2
            answer = game.step(str(guess))
            if answer is None:
                return game.reward()
            low, high = (guess + 1, high) if "higher" in answer else (low, guess - 1)

    # "5" every turn: found only for secret 5 (1); else 0.5 * (1 - |5 - s| / 8), over the 8 other secrets
    # 0.5 * (8 - (4+3+2+1+1+2+3+4) / 8) = 0.5 * (8 - 2.5) = 2.75; mean (1 + 2.75) / 9 = 0.41667
    assert sum(constant(s) for s in range(1, 10)) / 9 == pytest.approx(3.75 / 9)
    # a halving search finds each of 9 numbers within 4 tries (2^4 - 1 = 15 >= 9): reward 1 for every secret
    assert [halving(s) for s in range(1, 10)] == [1.0] * 9


def test_a_game_outside_its_range_is_refused():
    with pytest.raises(ValueError, match=r"1 <= secret <= top \(got secret=10, top=9, tries=4\)"):
        Game(secret=10)
    assert Game(secret=12, top=20).prompt() == "Guess my number from 1 to 20. Answer with one number."


needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="verifiers is an optional extra: pip install 'covey[verifiers]'")


@needs_verifiers
def test_the_taskset_s_tasks_are_the_rows_and_its_options_the_json():
    from covey.envs.verifiers import VerifiersError, verifiers_data
    data = verifiers_data(f"verifiers:{TARGET}", 4, 2)
    # task i's secret is random.Random(i).randint(1, 9): 7, 3, 1, 4, 4, 5 for i = 0..5
    assert [ex.meta["secret"] for ex in data.train + data.eval] == [7, 3, 1, 4, 4, 5]
    assert {ex.prompt for ex in data.train + data.eval} == {PROMPT}
    assert data.eval[0].meta == {"secret": 4, "top": 9, "tries": 4, "verifiers_idx": 4}
    wide = verifiers_data(f'verifiers:{TARGET} {{"taskset": {{"top": 20, "tries": 5}}}}', 2, 0)
    # random.Random(i).randint(1, 20): 13, 5 for i = 0, 1
    assert [(ex.meta["secret"], ex.meta["tries"]) for ex in wide.train] == [(13, 5), (5, 5)]
    assert wide.train[0].prompt == "Guess my number from 1 to 20. Answer with one number."
    with pytest.raises(VerifiersError, match="ValidationError"):
        verifiers_data(f'verifiers:{TARGET} {{"taskset": {{"top": 1}}}}', 2, 0)


@needs_verifiers
def test_episodes_against_the_tiny_model_score_as_the_rules_say(tiny_model_dir):
    from covey.envs.harness import harness_prompts
    from covey.envs.verifiers import VerifiersEngine, verifiers_data, verifiers_options
    from covey.models.load import load_policy
    from covey.rollout.fast import FastEngine
    from covey.serve import context_length
    model, tokenizer = load_policy(tiny_model_dir)
    data = verifiers_data(f"verifiers:{TARGET}", 2, 0)
    engine = VerifiersEngine(FastEngine(model.eval(), tokenizer, max_new_tokens=6, temperature=1.0),
                             verifiers_options(TARGET, 4, 120.0, 6, 1.0, 1.0), context_length(model))
    out = engine.generate(harness_prompts(tokenizer, data.train), 2, seeds=[7, 8])
    metrics = engine.take_metrics()
    assert metrics["verifiers/episodes"] == 4 and metrics["verifiers/failed"] == 0
    for i in range(len(out)):
        replies = [m["content"].strip() for m in out.messages[i] if m["role"] == "assistant"]
        answers = [m["content"] for m in out.messages[i] if m["role"] == "user"]
        game = Game(data.train[out.example_index[i]].meta["secret"])
        assert [game.step(r) for r in replies] == [*answers, None]  # the environment's answers, replayed
        assert out.environment_rewards[i].item() == pytest.approx(game.reward())
        env_text = tokenizer.decode(out.response_ids[i][(out.response_attention[i] - out.response_mask[i]).bool()])
        assert all(a in env_text for a in answers)  # attended, not trained
    assert metrics["verifiers/turns_mean"] > 1 and "verifiers/metric/valid" in metrics


def example_command() -> list[str]:
    """The `covey train ...` command of the example's docstring, continuation lines joined."""
    doc = ast.get_docstring(ast.parse((ROOT / TARGET).read_text()))
    return shlex.split(doc.split("covey train ", 1)[1].split("\n\n", 1)[0].replace("\\\n", " "))


@needs_verifiers
def test_the_example_s_command_trains_and_resumes_exactly(tiny_model_dir, tmp_path):
    """The docstring's command on the tiny model: two steps in one go, and one step then a resume to two: the
    same second step (timings aside)."""
    argv = example_command()
    assert f"task.source=verifiers:{TARGET}" in argv

    def run(folder, steps: int, *extra: str) -> list[dict]:
        cfg = load_config(None, [*argv, *tiny_overrides(tiny_model_dir, tmp_path / folder, **{
            "task.train_size": 8, "task.eval_size": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 6,
            "rollout.eval_max_new_tokens": 6, "train.steps": steps, "train.save_every": 1}), *extra])
        result = covey.train(cfg)
        return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]

    whole, step2 = resumed_step_two(run)
    assert step2["verifiers/episodes"] == 4 and step2["reward/environment"] == step2["reward/mean"]
    assert step2["verifiers/reward/game"] == step2["reward/mean"]  # the game's reward is the episode's
    assert whole[0]["eval/verifiers/episodes"] == 2  # held-out rows play the game too (greedy)
