"""The rules of the higher-or-lower game (examples/higher_lower/higher_lower.py plays them in verifiers), in plain
Python: no verifiers needed to read or test them.

The environment picks a secret number from 1 to `top`; the player has `tries` replies. The first whole number in a
reply is its guess (a reply without one, or with one outside 1..top, is no guess). A wrong guess is answered
"No, higher." or "No, lower.", no guess is asked again; the game ends at the secret or after the last try.

Reward (`Game.reward`): 1 when the secret was guessed; else half the closeness of the last guess,
0.5 * (1 - |guess - secret| / (top - 1)); 0 with no guess at all. Saying the same number every turn earns less than
varying it, and only reading the answers (a halving search finds any of 9 numbers in 4 tries) earns 1 every time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

NUMBER = re.compile(r"\d+")


def read_guess(reply: str, top: int) -> int | None:
    """The reply's first whole number when it lies in 1..top, else None."""
    found = NUMBER.search(reply)
    if found is None:
        return None
    guess = int(found.group(0))
    return guess if 1 <= guess <= top else None


def unit(top: int) -> str:
    return "one digit" if top <= 9 else "one number"


@dataclass
class Game:
    """One game: `step` each reply, then `reward` and `metrics`."""
    secret: int
    top: int = 9
    tries: int = 4
    guesses: list[int | None] = field(default_factory=list)

    def __post_init__(self):
        if self.top < 2 or self.tries < 1 or not 1 <= self.secret <= self.top:
            raise ValueError(f"higher_lower: a game needs top >= 2, tries >= 1 and 1 <= secret <= top (got secret="
                             f"{self.secret}, top={self.top}, tries={self.tries})")

    def prompt(self) -> str:
        return f"Guess my number from 1 to {self.top}. Answer with {unit(self.top)}."

    @property
    def found(self) -> bool:
        return self.secret in self.guesses

    @property
    def over(self) -> bool:
        return self.found or len(self.guesses) >= self.tries

    def step(self, reply: str) -> str | None:
        """Read one reply; the environment's answer, or None when the game is over."""
        if self.over:
            raise ValueError("higher_lower: the game is over")
        guess = read_guess(reply, self.top)
        self.guesses.append(guess)
        if self.over:
            return None
        if guess is None:
            return f"Answer with {unit(self.top)} from 1 to {self.top}."
        return f"No, {'higher' if guess < self.secret else 'lower'}. Guess again."

    def closeness(self) -> float:
        """1 - |last guess - secret| / (top - 1); 0 with no guess."""
        valid = [g for g in self.guesses if g is not None]
        return 1.0 - abs(valid[-1] - self.secret) / (self.top - 1) if valid else 0.0

    def reward(self) -> float:
        return 1.0 if self.found else 0.5 * self.closeness()

    def followed(self) -> float | None:
        """Of the guesses that answer a "higher" or "lower", the share that went that way (None: none did)."""
        pairs = [(a, b) for a, b in zip(self.guesses, self.guesses[1:]) if a is not None and b is not None]
        if not pairs:
            return None
        return sum((b > a) == (a < self.secret) and b != a for a, b in pairs) / len(pairs)

    def metrics(self) -> dict[str, float]:
        """found (0/1), turns, valid (share of replies that were guesses), closeness, followed (when defined)."""
        out = {"found": float(self.found), "turns": float(len(self.guesses)), "closeness": self.closeness(),
               "valid": sum(g is not None for g in self.guesses) / max(1, len(self.guesses))}
        followed = self.followed()
        if followed is not None:
            out["followed"] = followed
        return out
