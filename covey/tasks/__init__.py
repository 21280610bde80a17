"""Prompt sources: synthetic generators (arithmetic, multistep, word problems), JSONL files, saved
Hugging Face datasets."""

from covey.tasks.arithmetic import arithmetic_splits, generate_arithmetic
from covey.tasks.base import Example, build_messages
from covey.tasks.files import DataError, load_examples, load_hf_dataset, load_jsonl
from covey.tasks.multistep import generate_multistep, label_steps, multistep_splits, split_steps
from covey.tasks.wordproblems import generate_wordproblems, wordproblem_splits

__all__ = [
    "DataError", "Example", "arithmetic_splits", "build_messages", "generate_arithmetic",
    "generate_multistep", "generate_wordproblems", "label_steps", "load_examples", "load_hf_dataset",
    "load_jsonl", "multistep_splits", "split_steps", "wordproblem_splits",
]
