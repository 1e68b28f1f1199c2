"""Writes demonstrations for a built-in task as a chat file (JSON lines, OpenAI's message
format) that ``m2flow sft`` trains on (``data.source=FILE``), to read or edit first.

    python scripts/demonstrations.py calculation --n 2000 --split train --out calc_train.jsonl

``calculation``: a call of the calculator with the problem's expression, the calculator's
result, and the answer in ``\\boxed{}`` (``m2flow.data.chats.calculation_chats``; the same
chats as ``data.source=calculation``). ``invented``: a search for each entity the answer is
found through, the search tool's passages, and the answer (``invented_chats``)."""

import argparse
import json

from m2flow.data.chats import DEMONSTRATIONS as TASKS

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--n", type=int, default=1000, help="chats to write")
    parser.add_argument("--split", choices=("train", "test"), default="train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instruction", default="Put the final answer in \\boxed{}.")
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    args = parser.parse_args()
    chats = TASKS[args.task](args.n, args.split, args.seed, args.instruction)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(c) + "\n" for c in chats)
    print(f"{len(chats)} chats -> {args.out}")
