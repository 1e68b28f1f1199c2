"""Command line: ``m2flow demo``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="m2flow", description="Flexible, efficient, large-scale RL training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="place a few workers on an embedded Ray and stream data between them")
    demo.add_argument("--out", default="runs/demo", help="where the trace is written")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from m2flow.demo import run_demo

        run_demo(args.out)


if __name__ == "__main__":
    main()
