"""Fixtures of the policy-server tests: the tiny model behind the fast engine, served once per test module, and
an OpenAI client pointed at it."""

import pytest

MAX_NEW = 8


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """(model, tokenizer) of the tiny model, in eval mode on the CPU."""
    from covey.models.load import load_policy
    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def served(policy):
    """(server, engine): the fast engine (temperature 1, 8 new tokens) behind a started PolicyServer."""
    from covey.rollout.fast import FastEngine
    from covey.serve import PolicyServer, ServerOptions, context_length
    model, tokenizer = policy
    engine = FastEngine(model, tokenizer, max_new_tokens=MAX_NEW, temperature=1.0)
    server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=MAX_NEW,
                                                context_length=context_length(model), batch_window_s=0.02))
    server.start()
    yield server, engine
    server.close()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI
    return OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
