"""Command line: ``m2flow train PRESET [key=value ...]``, ``m2flow presets``, ``m2flow demo``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="m2flow", description="Flexible, efficient, large-scale RL training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a preset, e.g. embodied/ppo_cartpole placement.mode=hybrid")
    train.add_argument("preset", help="a preset name (m2flow presets lists them) or a YAML file")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides")
    sub.add_parser("presets", help="list the presets")
    demo = sub.add_parser("demo", help="place a few workers on an embedded Ray and stream data between them")
    demo.add_argument("--out", default="runs/demo", help="where the trace is written")
    args = parser.parse_args(argv)

    if args.command == "train":
        from m2flow.config import load_config
        from m2flow.runners import run

        run(load_config(args.preset, args.overrides))
    elif args.command == "presets":
        from m2flow.config import presets

        print("\n".join(presets()))
    elif args.command == "demo":
        from m2flow.demo import run_demo

        run_demo(args.out)


if __name__ == "__main__":
    main()
