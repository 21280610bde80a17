"""`covey serve-policy MODEL`: a model behind covey's fast engine, served over an OpenAI-compatible HTTP API
that returns the sampled token ids and their log-probs (covey/serve/server.py, docs/environments.md)."""

from __future__ import annotations

import os
import signal
import sys
import threading

HELP = "serve a model over an OpenAI-compatible API with token ids and log-probs: covey serve-policy MODEL"


def add_parser(sub) -> None:
    p = sub.add_parser("serve-policy", help=HELP, description=HELP)
    p.add_argument("model", help="a model folder, a .gguf file, 'default' (SmolLM2-135M-Instruct) or 'tiny'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="a request's max_tokens when it sends none")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the engine's sampling temperature (requests must omit it, match it, or send 0: greedy)")
    p.add_argument("--slots", type=int, default=0, help="decode rows through this many slots, refilled as rows "
                                                       "finish (rollout.slots; 0: every row of a call at once)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    p.add_argument("--name", default="", help="the model id /v1/models lists (default: MODEL)")
    p.add_argument("--token-env", default="COVEY_POLICY_TOKEN",
                   help="environment variable holding the bearer token clients must send (unset: no token)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (413 beyond)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long the engine waits for more requests after the first before it samples")
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.cli.common import quiet_progress_bars
    from covey.serve import PolicyServer

    if args.max_new_tokens < 1 or args.temperature <= 0 or args.slots < 0 or args.max_body_mb <= 0:
        raise ValueError("--max-new-tokens must be >= 1, --temperature > 0, --slots >= 0 and --max-body-mb > 0")
    quiet_progress_bars()
    engine, options = build(args, os.environ.get(args.token_env, ""))
    try:
        server = PolicyServer(engine, options, args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if args.host not in ("127.0.0.1", "localhost"):
        print(f"covey serve-policy: warning: listening on {args.host} (plain HTTP; use TLS in front"
              f"{'' if options.token else ', and set ' + args.token_env})", file=sys.stderr)
    print(f"covey serve-policy: {options.model_name} on {server.url}/v1 ({engine.decode_path()}; context "
          f"{options.context_length} tokens; {'token required' if options.token else 'no token'})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()  # the open connections, the engine's thread
    return 0


def build(args, token: str):
    """(the fast engine on the model, the server's options) for the command's arguments."""
    from covey.models.load import load_policy
    from covey.rollout.local import DecodeOptions, local_engine
    from covey.runtime.dist import resolve_device
    from covey.serve import ServerOptions, context_length

    policy, tokenizer = load_policy(args.model, device=resolve_device(args.device))
    policy.eval()
    engine = local_engine("fast", policy, tokenizer, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, decode=DecodeOptions(slots=args.slots))
    vocab = max(len(tokenizer), int(getattr(policy.config, "vocab_size", 0) or 0))
    options = ServerOptions(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            context_length=context_length(policy, tokenizer), model_name=args.name or args.model,
                            token=token, vocab_size=vocab, max_body_bytes=int(args.max_body_mb * 2**20),
                            batch_window_s=args.batch_window_ms / 1000, verbose=args.verbose)
    return engine, options
