"""Prompt sources and their verifiers.

- base: the Example every task produces, and its chat messages;
- synthetic generators: arithmetic (the default task), multistep (checkable steps, for process
  supervision), wordproblems (short stories), code (programs for the sandboxed code reward);
- files: prompts from JSONL, JSON, CSV and Parquet files and saved Hugging Face datasets;
- sft_data: demonstrations for supervised fine-tuning, rendered to token ids with the assistant's tokens marked;
- reasoning_gym: reasoning-gym's generators by name (task.name=reasoning_gym:<dataset>), their options
  checked against the generator's config, the held-out split drawn as the built-in generators draw it,
  and the dataset's own score_answer as the verifier;
- data: from the task config to chat-formatted prompts, and a resumable prompt stream;
- answers: final-answer extraction, number normalisation and answer equivalence; verifiers: is a
  completion's answer the reference answer, one verifier per kind of answer;
- tools: built-in tools a model can call during an episode (the calculator).
"""

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
