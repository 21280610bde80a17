"""`covey serve-reward [PRESET|FILE] [key=value ...]`: the configured reward over HTTP (covey/rewards/server.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading


def add_parser(sub) -> None:
    p = sub.add_parser("serve-reward", help="serve the configured reward over HTTP: covey serve-reward "
                       "[CONFIG.yaml] [key=value ...] [--port 8765]")
    p.add_argument("args", nargs="*", help="optional YAML preset, then key=value overrides (reward.*)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0 = any free port)")
    p.add_argument("--token-env", default="COVEY_REWARD_TOKEN", help="environment variable holding the token")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body (413 beyond)")
    p.add_argument("--max-batch", type=int, default=256, help="most items per request (413 beyond)")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds to receive a request (408 after)")
    p.add_argument("--verbose", action="store_true", help="log every request to stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.config import load_config, split_config
    from covey.rewards.build import build_rewarder
    from covey.rewards.server import MiB, RewardServer, RewardService, ServeError, ServerLimits
    from covey.tasks.verifiers import resolve_verifier
    from covey.training.plan import make_plan

    token = os.environ.get(args.token_env, "")
    if not token:
        raise ServeError(f"set {args.token_env} to the bearer token clients must send")
    if args.max_batch < 1 or args.max_body_mb <= 0 or args.request_timeout <= 0:
        raise ServeError("--max-batch, --max-body-mb and --request-timeout must be > 0")
    config_path, overrides = split_config(args.args)
    cfg = load_config(config_path, overrides)
    limits = ServerLimits(int(args.max_body_mb * MiB), args.max_batch, args.request_timeout)
    try:  # no data to read answers from: auto means math here unless a string verifier is named
        rewarder = build_rewarder(make_plan(cfg).rewards, verifier=resolve_verifier(cfg.eval.metric, []))
        server = RewardServer((args.host, args.port), RewardService(rewarder), token, limits, args.verbose)
    except OSError as e:
        raise ServeError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"covey serve-reward: warning: listening on {args.host} (plain HTTP; use TLS in front)", file=sys.stderr)
    print(f"covey serve-reward: listening on {server.url} (terms: {', '.join(server.service.term_names)})",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
