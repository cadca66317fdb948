"""The benchmark's top level: ``main()`` parses the command line and either serves one method
as a child process (``--only``) or runs every model in turn — its methods, the printed tables,
the markdown section and the figure."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from .cli import parse_args
from .config import METHODS
from .measure import run_child
from .plot import write_plot
from .report import (
    engine_revision,
    machine_info,
    markdown_section,
    section_key,
    setup_lines,
    title,
    write_markdown,
)
from .schedule import run_all
from .tables import format_text, results_table, versus_opacus_table


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.only:
        run_child(args)
        return
    everything: Dict[str, Dict[str, dict]] = {}
    for model in args.models:
        args.model = model
        everything[model] = run_model(args)
        if args.plot:  # redrawn after each model: a later failure still leaves the figure so far
            write_plot(args, everything)


def run_model(args) -> Dict[str, dict]:
    """Every method on ``args.model``: run, print the tables, write the markdown section."""
    methods = [m for m in METHODS if m in args.methods]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results = run_all(args, methods)
    info = machine_info(args.device, load)
    print(f"\n{title(args, info)}\n{info['machine']}\n{info['software']}; "
          f"private_engine at commit {engine_revision()}")
    for line in setup_lines(args, results):
        print(line)
    print("\n" + format_text(results_table(results, args.device == "cuda")))
    vs = versus_opacus_table(results)
    if vs:
        print("\nprivate_engine vs Opacus (ratios below 1 favour private_engine):\n"
              + format_text(vs))
    if args.markdown:
        write_markdown(Path(args.markdown), markdown_section(args, results, info),
                       section_key(args))
        print(f"\nwrote {args.markdown}")
    return results
