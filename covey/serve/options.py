"""What the policy server is told (`ServerOptions`), and the errors its routes answer with (`RequestError`)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


class RequestError(ValueError):
    """A request the server refuses: its HTTP status (400 unless said) and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineFault(RuntimeError):
    """The engine raised on a request (answered 500); the server keeps serving."""


@dataclass(frozen=True)
class ServerOptions:
    """How the server samples and what it accepts. The sampling settings are the engine's own: the server
    cannot change them per request, it only checks that a request asks for what the engine does."""

    temperature: float
    """The engine's sampling temperature: a request's `temperature` must be omitted, equal to it, or 0
    (greedy). The log-probs returned are under the model's logits / this temperature."""
    max_new_tokens: int
    """A request's `max_tokens` when it sends none."""
    context_length: int
    """The model's context (`context_length(model)`): prompt + max_tokens beyond it is refused."""
    top_p: float = 1.0
    """The engine's top-p: a request's `top_p` must be omitted or equal to it."""
    model_name: str = "covey-policy"
    """The id /v1/models lists and every response names (a request's `model` is not checked)."""
    token: str = ""
    """Bearer token every route but /health requires; empty: none."""
    vocab_size: int = 0
    """Largest token id + 1 a token-id prompt may hold; 0: the tokenizer's length."""
    max_n: int = 64
    """Most choices per request (`n`)."""
    max_body_bytes: int = 8 * MiB
    """Largest request body (413 beyond)."""
    request_timeout_s: float = 30.0
    """Socket timeout while reading a request (408 after)."""
    generate_timeout_s: float = 600.0
    """Longest wait for the engine's answer to one request (503 after)."""
    batch_window_s: float = 0.005
    """How long the engine's thread waits for more requests after the first before it samples."""
    max_batch_rows: int = 256
    """Most rows (prompts x n) in one engine call."""
    max_episodes: int = 4096
    """Episode traces kept; the oldest is dropped beyond (take them with `take_episode`)."""
    verbose: bool = False
    """Log every request to stderr."""


def context_length(model, tokenizer=None) -> int:
    """The context of a Hugging Face causal LM: its config's `max_position_embeddings` (or the tokenizer's
    `model_max_length` where the config has none and the tokenizer's is a real number)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**8:
        return limit
    raise ValueError("the model's context length is unknown (no max_position_embeddings): pass context_length")
