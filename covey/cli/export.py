"""`covey export RUN_DIR --to gguf|merged|hf [--quant f16|q8_0] [--out PATH]`: a finished run's model as a
llama.cpp GGUF file, its LoRA adapters merged into full weights, or a plain Hugging Face folder (docs/export.md)."""

from __future__ import annotations

HELP = "a finished run's model as a GGUF file, merged LoRA weights or a plain HF folder"
TARGETS = ("gguf", "merged", "hf")  # covey.models.export.TARGETS: the parser loads no torch
QUANTS = ("f16", "q8_0")  # covey.models.gguf_writer.QUANTS


def add_parser(sub) -> None:
    p = sub.add_parser("export", help=HELP, description=HELP)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding final/")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="gguf: one llama.cpp file (Llama-architecture models); merged: a LoRA run's adapters "
                        "merged into the base weights; hf: the final model as a plain HF folder")
    p.add_argument("--quant", default="f16", choices=QUANTS, help="GGUF precision of the matrices (--to gguf)")
    p.add_argument("--out", default="", help="output file or folder (default: RUN_DIR/export/RUN-QUANT.gguf, "
                                             "RUN_DIR/export/merged, RUN_DIR/export/hf)")
    p.set_defaults(func=run)


def run(args) -> int:
    from covey.models.export import export_run
    if args.quant != "f16" and args.to != "gguf":
        args.command_parser.error(f"--quant {args.quant} applies to --to gguf only")
    print(export_run(args.run_dir, args.to, args.out or None, args.quant))
    return 0
