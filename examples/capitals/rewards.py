"""Reward functions for the capitals example (docs/your-task.md), written the way TRL's
documentation writes them: keyword arguments, `**kwargs` for the columns a function does not use."""

import re
import string


def _words(text):
    """Lower case, punctuation and the articles a/an/the removed, one space between words."""
    text = text.lower().translate(str.maketrans(string.punctuation, " " * len(string.punctuation)))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def capital_reward(completions, answer, **kwargs):
    """1.0 for a reply that is just the capital ("Paris."), 0.5 for one that names it in a sentence
    ("The capital of France is Paris."), 0.0 otherwise."""
    scores = []
    for completion, capital in zip(completions, answer):
        reply, want = _words(completion), _words(capital)
        if reply == want:
            scores.append(1.0)
        elif re.search(rf"\b{re.escape(want)}\b", reply):
            scores.append(0.5)
        else:
            scores.append(0.0)
    return scores
