"""A multi-turn environment where the reward needs several turns: guess a secret number from
"higher" / "lower" feedback, in TRL's environment_factory form (docs/agents.md).

    covey train rollout.environment=examples/number_guess/guess_env.py:GuessEnv \
        task.name=file task.path=examples/number_guess/train.jsonl reward.correctness=0 eval.metric=reward \
        rollout.tool_demo=examples/number_guess/demo.json reward.tool_use=0.2 rollout.max_turns=8

Each episode gets its own instance; reset(**row) reads the row's `secret` column; the model's
`guess` calls are the environment's tool; get_reward() scores the episode: 1 for finding the
number, less the more guesses it took, 0 when it never did.

SmolLM2-135M-Instruct never calls a tool it is only told about: its replies are Python code, so
every reward is 0 and nothing is learned (covey says so at the first step). demo.json shows it one
worked game (calls, replies, answer) before each question, and reward.tool_use pays 0.2 for an
episode with an answered call, a signal while it cannot find the number yet; with both, every
held-out episode of the untrained model calls `guess` once. Eight turns leave room for the
seven guesses a halving search needs.
"""


class GuessEnv:
    """A secret number between 1 and 100; each guess is answered higher, lower or correct."""

    def reset(self, **row) -> str:
        self.secret, self.guesses, self.found = int(row["secret"]), 0, False
        return " Call guess with a number until the answer is correct."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: A whole number between 1 and 100.
        """
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return max(0.0, 1.0 - 0.1 * (self.guesses - 1)) if self.found else 0.0
