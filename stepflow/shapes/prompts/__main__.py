"""``python -m stepflow.shapes.prompts --write`` regenerates the prompt files; ``--check`` verifies them."""

from __future__ import annotations

import argparse
import sys

from stepflow.shapes.prompts import (
    SPLITS,
    generate_records,
    load_prompts,
    prompt_file,
    prompt_space_sizes,
    write_prompt_files,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="(re)write train/eval prompt files in the package")
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ from the generator")
    args = ap.parse_args(argv)
    if args.write:
        for p in write_prompt_files():
            print(f"wrote {p}")
    if args.check:
        bad = [s for s in SPLITS if load_prompts(s) != generate_records(s)]
        if bad:
            print(f"prompt files out of date: {bad}; run python -m stepflow.shapes.prompts --write", file=sys.stderr)
            return 1
    print("prompt space:", prompt_space_sizes())
    for s in SPLITS:
        if prompt_file(s).exists():
            print(f"{s}: {len(load_prompts(s))} lines in {prompt_file(s)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
