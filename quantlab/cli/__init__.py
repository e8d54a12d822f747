"""`quantlab` command line: parses arguments and calls the library, nothing more.

One module per command group: run.py (run, report, compare), models.py (list, info, estimate),
mixed.py (sensitivity, mixed), lmeval.py (lm-eval), doctor.py (doctor).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import doctor, lmeval, mixed, models, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantlab", description="quantization experiments on small LMs")
    parser.add_argument("--cache-dir", default=os.environ.get("QUANTLAB_CACHE_DIR"),
                        help="converted models and token caches (default ~/.cache/quantlab; env QUANTLAB_CACHE_DIR)")
    parser.add_argument("--data-dir", default=os.environ.get("QUANTLAB_DATA_DIR"),
                        help="directory with the wikitext-2 files (env QUANTLAB_DATA_DIR; default: ../shared/data/wikitext-2)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging from quantlab (e.g. the traceback of a failed run)")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (run, models, mixed, lmeval, doctor):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # -v: DEBUG for quantlab's own loggers only (torch / transformers / matplotlib debug output is noise)
    logging.getLogger("quantlab").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"quantlab: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
