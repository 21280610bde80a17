"""The command line: argv only, one module per command, the entry point and its error policy.

- main: the parser built from the command modules, `entry` (the `covey` script) and the error
  policy (a user error is one line and exit 2); __main__: `python -m covey.cli`;
- common: what several commands share (their config with the CPU settings applied, the device);
- one module per command: train (`covey train`), sft (`covey sft`), eval (`covey eval`), rm (`covey train-rm`,
  `covey eval-rm`), serve (`covey serve-reward`), serve_policy (`covey serve-policy`), export (`covey export`),
  plot (`covey plot`), compare (`covey compare`), advantages (`covey advantages`).

Only here are covey modules imported inside functions: building the parser loads no torch.
"""
