"""Build the shipped offline harness tasks' data from the Python standard library (always on
this machine), deterministically. Run once; its output (tasks/*.jsonl) is committed beside the
YAMLs:

    python trainer/interop/make_tasks.py

- kitchen_next_line (multiple_choice): four lines of a stdlib module, then which of four lines
  comes next: its own next line or the line after some other module's four. Chance is 25%.
- kitchen_stdlib_ppl (loglikelihood_rolling): word/byte perplexity and bits per byte of short
  stdlib passages.
- kitchen_complete_line (generate_until): the first half of a line; greedy completion to the
  end of the line, scored by exact match.
The modules come from `json`, `http` and `csv`: packages the guides' tiny models may or may not
have seen, which is fine for a smoke test of the harness, not for a benchmark.
"""

import json
import random
import sysconfig
from pathlib import Path

HERE = Path(__file__).parent / "tasks"
PACKAGES = ("json", "http", "csv.py", "urllib")


def lines_of_stdlib() -> list[list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in PACKAGES:
        path = root / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    out = []
    for f in files:
        lines = [ln for ln in f.read_text().splitlines() if len(ln.strip()) > 8]
        if len(lines) > 20:
            out.append(lines)
    return out


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / f"{name}.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def main() -> None:
    rng = random.Random(19)
    files = lines_of_stdlib()
    questions = []
    for _ in range(40):
        i, *others = rng.sample(range(len(files)), 4)
        start = rng.randrange(len(files[i]) - 5)
        context = "\n".join(files[i][start : start + 4]) + "\n"
        choices = [files[i][start + 4]]
        for j in others:
            k = rng.randrange(len(files[j]) - 5)
            choices.append(files[j][k + 4])
        gold = rng.randrange(4)
        choices[0], choices[gold] = choices[gold], choices[0]
        questions.append({"context": context, "choices": choices, "gold": gold})
    write("kitchen_next_line", questions)
    passages = []
    for _ in range(20):
        lines = rng.choice(files)
        start = rng.randrange(len(lines) - 8)
        passages.append({"text": "\n".join(lines[start : start + 8]) + "\n"})
    write("kitchen_stdlib_ppl", passages)
    completions = []
    for _ in range(30):
        line = rng.choice(rng.choice(files))
        cut = len(line) // 2
        completions.append({"prefix": line[:cut], "rest": line[cut:]})
    write("kitchen_complete_line", completions)


if __name__ == "__main__":
    main()
