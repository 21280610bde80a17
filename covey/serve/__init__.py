"""The policy server: covey's engine over an OpenAI-compatible HTTP API, token-faithful (the ids sampled and
the sampler's log-probs per call, episode traces), batching concurrent requests into the engine's decode
(docs/environments.md).

- server: `PolicyServer` (the routes over the standard library's HTTP server, run in a background thread
  or in the foreground), its status codes and security;
- service: the routes' work apart from HTTP (prompt ids, context and episode checks, responses);
- batcher: the engine's one thread: requests join the engine's running decode as slots free
  (`Engine.serve_rows`, covey/rollout/stream.py), or, for an engine without it, gathered into
  `engine.generate` calls;
- episodes: the traces of multi-turn episodes and the rule that a call extends its episode;
- requests: request bodies read into typed requests or refused in one line; responses: samples into
  OpenAI's response objects; texts: the server's copy of the tokenizer (chat template, tool calls);
- options: `ServerOptions`, `context_length`, the errors the routes answer with.

    from covey.serve import PolicyServer, ServerOptions, context_length
    server = PolicyServer(engine, ServerOptions(temperature=1.0, max_new_tokens=256,
                                                context_length=context_length(model)))
    url = server.start()            # http://127.0.0.1:<free port>; OpenAI(base_url=url + "/v1")
    ...
    trace = server.take_episode("episode-7")
    server.close()
"""

from covey.serve.options import EngineFault, RequestError, ServerOptions, context_length
from covey.serve.server import PolicyServer

__all__ = ["EngineFault", "PolicyServer", "RequestError", "ServerOptions", "context_length"]
