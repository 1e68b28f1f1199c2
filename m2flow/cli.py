"""Command line: ``m2flow train PRESET [key=value ...]``, ``m2flow sft PRESET [key=value ...]``
(a supervised preset's run), ``m2flow config PRESET [key=value ...]``,
``m2flow profile PRESET [key=value ...]``, ``m2flow plan (PRESET | --profile FILE) [--devices N]
[--nodes M]``, ``m2flow eval PRESET checkpoint=FILE [episodes=N] [out=FILE] [key=value ...]``,
``m2flow trace RUN_DIR``, ``m2flow status RUN_DIR``, ``m2flow presets``, ``m2flow demo``.

A config mistake is one line on stderr, ``m2flow: error: key.path: ...``, and exit status 2,
before anything starts. A worker's failure during a run is one paragraph (component, rank,
exception, the last frames of its code) and exit status 1; the worker's whole traceback is in
the run's ``log.txt``. ``m2flow --debug ...`` shows the tracebacks instead. SIGINT (Ctrl-C)
or SIGTERM stops a run after the update in progress, with a checkpoint: one line, and exit
status 128 + the signal's number (130, 143); the same signal again stops it at once.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="m2flow", description="Flexible, efficient, large-scale RL training on Ray.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a config error or a worker's failure")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a preset, e.g. embodied/ppo_cartpole placement.mode=hybrid")
    sft = sub.add_parser("sft", help="supervised fine-tuning on chats, e.g. sft/calc_tiny; the model it writes "
                                     "starts a later run (model.path=<runner.out_dir>/model)")
    config = sub.add_parser("config", help="print the resolved config of a preset with overrides (YAML)")
    for p in (train, sft, config):
        p.add_argument("preset", help="a preset name (m2flow presets lists them) or a YAML file")
        p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    config.add_argument("--docs", action="store_true", help="add each key's doc as a comment")
    prof = sub.add_parser("profile", help="measure each component of a preset's flow on this hardware (a JSON file)")
    prof.add_argument("preset", help="a preset name or a YAML file")
    prof.add_argument("overrides", nargs="*", help="key.path=value overrides")
    plan = sub.add_parser("plan", help="the best plan for a profiled flow, on this cluster or a larger one")
    plan.add_argument("preset", nargs="?", help="a preset (its stored profile, or a new one); or give --profile")
    plan.add_argument("overrides", nargs="*", help="key.path=value overrides (e.g. a larger batch)")
    plan.add_argument("--profile", help="a profile file (m2flow profile writes one)")
    plan.add_argument("--devices", type=int, help="devices to plan for (default: the profile's)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    plan.add_argument("--internode", type=float, default=4.0,
                      help="how much slower a data-parallel exchange is across nodes than within one")
    plan.add_argument("--out", help="write the best plan here (YAML; run it with placement=@FILE)")
    ev = sub.add_parser("eval", help="score a checkpoint: reasoning, greedy accuracy on a data set; embodied, "
                                     "return and success over episodes")
    ev.add_argument("preset", help="the preset (or YAML file) the checkpoint was trained with")
    ev.add_argument("overrides", nargs="*", help="checkpoint=FILE (or checkpoint=auto: the latest complete one of "
                    "runner.out_dir); episodes=N (embodied, default 10); out=FILE (the JSON result, default "
                    "<checkpoint>.eval.json); and key.path=value overrides, e.g. data.source=FILE")
    tr = sub.add_parser("trace", help="what each component of a finished run did: seconds computing, waiting "
                                      "and syncing weights (from its trace.json)")
    tr.add_argument("run_dir", help="the run's runner.out_dir (or a trace.json file)")
    st = sub.add_parser("status", help="where a run is, or how it ended (its status.json; exit status 1 if it "
                                       "stopped, hung, failed or ended without a word)")
    st.add_argument("run_dir", help="the run's runner.out_dir")
    sub.add_parser("presets", help="list the presets")
    demo = sub.add_parser("demo", help="place a few workers on an embedded Ray and stream data between them")
    demo.add_argument("--out", default="runs/demo", help="where the trace is written")
    args = parser.parse_args(argv)

    from m2flow.config import ConfigError
    from m2flow.runtime.stop import RunStopped

    try:
        command(args)
    except ConfigError as e:
        if args.debug:
            raise
        print(f"m2flow: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except RunStopped as e:  # SIGINT or SIGTERM during a run: the shell's status for a signal's end
        print(f"m2flow: {e}", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    except KeyboardInterrupt as e:  # a run's second signal, or Ctrl-C outside a run
        if args.debug:
            raise
        print(f"m2flow: {str(e) or 'interrupted'}", file=sys.stderr)
        raise SystemExit(130) from None


def command(args: argparse.Namespace) -> None:
    if args.command in ("train", "sft"):
        from m2flow.config import load_config
        from m2flow.runners import run
        from m2flow.runners.status import RunFailed
        from m2flow.runtime.errors import WorkerError
        from m2flow.runtime.watchdog import RunHung

        cfg = load_config(args.preset, args.overrides)
        if (args.command == "sft") != (cfg.flow == "sft"):
            from m2flow.config import ConfigError

            raise ConfigError("flow", f"m2flow {args.command} runs " + (
                f"a supervised preset (flow: sft, e.g. sft/calc_tiny); {args.preset}'s flow is {cfg.flow}: "
                "m2flow train runs it" if args.command == "sft" else "an RL preset; a supervised one (flow: sft) "
                "runs with m2flow sft"))
        try:
            run(cfg)
        except (WorkerError, RunHung, RunFailed) as e:  # one paragraph here; the whole traceback is in the run's log
            if args.debug:
                raise
            whose = "the worker's " if isinstance(e, WorkerError) else ""
            traced = f"\n({whose}whole traceback: {cfg.runner.out_dir}/log.txt)" if getattr(e, "traced", True) else ""
            print(f"m2flow: {e}{traced}", file=sys.stderr)
            raise SystemExit(1) from None
        if args.command == "sft":
            model = f"{cfg.runner.out_dir}/model"
            print(f"model: {model} (a run starts from it with model.path={model})")
    elif args.command == "config":
        from m2flow.config import load_config, to_yaml

        print(to_yaml(load_config(args.preset, args.overrides), docs=args.docs), end="")
    elif args.command == "profile":
        from m2flow.config import load_config
        from m2flow.runners.profiling import load_or_profile
        from m2flow.runtime.stop import StopRequest

        with StopRequest("stopping after the probe's update in progress"):
            load_or_profile(load_config(args.preset, args.overrides))
    elif args.command == "plan":
        from m2flow.runners.auto import plan_command

        preset, overrides = args.preset, args.overrides
        if preset is not None and "=" in preset:  # m2flow plan --profile FILE key=value ...: no preset
            preset, overrides = None, [preset, *overrides]
        plan_command(preset, overrides, args.profile, args.devices, args.nodes, args.internode, args.out)
    elif args.command == "eval":
        from m2flow.config import ConfigError, load_config
        from m2flow.runners.evaluate import evaluate, table

        own = {"checkpoint": None, "episodes": "10", "out": None}  # eval's own keys, beside the config's
        overrides = []
        for o in args.overrides:
            key, _, value = o.partition("=")
            if key in own:
                own[key] = value
            else:
                overrides.append(o)
        if not own["checkpoint"]:
            raise ConfigError("checkpoint", "m2flow eval needs checkpoint=FILE (or checkpoint=auto)")
        if not own["episodes"].isdigit() or int(own["episodes"]) < 1:
            raise ConfigError("episodes", f"must be a whole number >= 1, got {own['episodes']!r}")
        cfg = load_config(args.preset, overrides, training=False)  # scores every row of a data file
        path = checkpoint_file(own["checkpoint"], cfg)
        print(table(evaluate(cfg, path, episodes=int(own["episodes"]), out=own["out"])))
    elif args.command == "trace":
        from m2flow.config import ConfigError
        from m2flow.runners.timeline import read, summary

        try:
            events = read(args.run_dir)
        except FileNotFoundError as e:
            raise ConfigError("run_dir", str(e)) from None
        print(summary(events))
    elif args.command == "status":
        from m2flow.config import ConfigError
        from m2flow.runners.status import describe

        try:
            text, well = describe(args.run_dir)
        except (FileNotFoundError, NotADirectoryError):
            raise ConfigError("run_dir", f"no status.json in {args.run_dir!r}: not a run's directory, or a "
                                         "run older than status files") from None
        except ValueError as e:  # not JSON, or not a status's fields
            raise ConfigError("run_dir", f"{args.run_dir}/status.json is no run status ({type(e).__name__}: "
                                         f"{e})") from None
        print(text)
        if not well:
            raise SystemExit(1)
    elif args.command == "presets":
        from m2flow.config import presets

        print("\n".join(presets()))
    elif args.command == "demo":
        from m2flow.config import ConfigError
        from m2flow.demo import run_demo
        from m2flow.runtime.cluster import ClusterStartError

        try:
            run_demo(args.out)
        except ClusterStartError as e:  # as a run's: one line
            raise ConfigError("cluster", str(e)) from e


def checkpoint_file(given: str, cfg) -> str:
    """``checkpoint=FILE``, or ``auto``: the latest complete checkpoint of ``runner.out_dir``."""
    from pathlib import Path

    from m2flow.config import ConfigError
    from m2flow.runners import checkpoint as checkpoints

    if given == "auto":
        where = checkpoints.directory(cfg.runner.out_dir)
        found = checkpoints.latest(where, log=lambda m: print(m, file=sys.stderr))
        if found is None:
            raise ConfigError("checkpoint", f"no complete checkpoint in {where}")
        return str(found)
    if not Path(given).is_file():
        raise ConfigError("checkpoint", f"no such checkpoint file {given!r}")
    return given


if __name__ == "__main__":
    main()
