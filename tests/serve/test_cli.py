"""`covey serve-policy` (covey/cli/serve_policy.py) as a user runs it: the tiny model on a free port, its token
from the environment, answers over HTTP, a clean exit on SIGTERM; a bad option is one line and exit 2."""

import os
import re
import signal
import subprocess
import sys

from tests.serve.support import request


def test_the_command_serves_the_model_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    env = {**os.environ, "COVEY_POLICY_TOKEN": "s3cret", "COVEY_MALLOC_KEEP": "0"}
    command = [sys.executable, "-m", "covey.cli", "serve-policy", tiny_model_dir, "--port", "0",
               "--max-new-tokens", "4", "--name", "tiny"]
    errors = open(tmp_path / "stderr.txt", "w+")
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    try:
        line = server.stdout.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1 .*token required", line)
        assert found, line + (tmp_path / "stderr.txt").read_text()[-2000:]
        url = found.group(1)
        assert request(url, "POST", "/v1/completions", {"prompt": "What is"})[0] == 401
        status, body = request(url, "POST", "/v1/completions", {"prompt": "What is", "return_token_ids": True},
                               {"Authorization": "Bearer s3cret"})
        assert status == 200 and body["model"] == "tiny" and len(body["choices"][0]["token_ids"]) <= 4
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        errors.close()


def test_a_bad_option_is_one_line_and_exit_2(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "covey.cli", "serve-policy", tiny_model_dir, "--temperature", "0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COVEY_MALLOC_KEEP": "0"})
    assert done.returncode == 2
    assert done.stderr.strip() == ("covey serve-policy: error: --max-new-tokens must be >= 1, --temperature > 0, "
                                   "--slots >= 0 and --max-body-mb > 0")
