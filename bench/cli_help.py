"""Start-up time of the CLI's help, against importing torch (issue 15, point 3).

Times, as whole processes (wall clock, best and median of --repeats), ``bertology --help`` and
``bertology COMMAND --help`` for every command that ``bertology --help`` lists (parsed from its output,
so new commands are picked up), against ``python -c "import torch"`` run alongside: each round runs
the baseline first and again after every --baseline-every commands. Prints each time and its ratio
to the torch import (target: at most 0.3x), and which of torch, transformers, sklearn, scipy and
matplotlib each help imported (one more, untimed, process per command: the console script run with
runpy, then a look at ``sys.modules``). With --importtime, also the heaviest packages behind
``import bertology.cli`` (``python -X importtime``) and under which bertology module each is imported.
The programs are the ones next to this Python (``.venv/bin/python``, ``.venv/bin/bertology``).
A measurement, not a test: the exit status is 0 whatever the ratios.

    .venv/bin/python bench/cli_help.py [--repeats 3] [--commands analyze,view] [--importtime]

To measure another checkout's code with this venv, put its src first:
``PYTHONPATH=/path/to/checkout/src .venv/bin/python bench/cli_help.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "sklearn", "scipy", "matplotlib")
TARGET = 0.3
PYTHON = sys.executable
BASELINE = "import torch"

#: Runs the console script as the shell would (runpy, as __main__), then records the top-level
#: packages in sys.modules, whatever way the command leaves (help exits with SystemExit).
PROBE = r"""
import json, runpy, sys
script, record, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
finally:
    with open(record, "w") as handle:
        json.dump(sorted({name.split(".")[0] for name in list(sys.modules)}), handle)
"""


def bertology_program() -> list[str]:
    """The console script next to this Python, else the one on PATH."""
    beside = Path(PYTHON).parent / "bertology"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("bertology")
    if found:
        return [found]
    raise SystemExit(f"no bertology console script next to {PYTHON} or on PATH")


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - started, done


def parse_commands(text: str) -> list[str]:
    """Command names from a help page: rich/typer/cyclopts panels (any panel not of options,
    arguments or parameters), click's plain ``Commands:`` section, or argparse's ``{a,b}``."""
    names: list[str] = []
    section = None  # None outside a command section; else the indent of its name lines
    for line in text.splitlines():
        stripped = line.strip()
        panel = re.match(r"^[╭┌┏+][─━-]*\s*(.*?)\s*[─━-]*[╮┐┓+]$", stripped)
        if panel:
            title = panel.group(1).lower()
            section = -1 if not re.search(r"option|argument|parameter|usage", title) else None
            continue
        if re.match(r"^(commands|subcommands|available commands)\s*:?$", stripped, re.IGNORECASE):
            section = -1
            continue
        if section is None:
            continue
        if stripped.startswith(("╰", "└", "┗")) or (not stripped and names) or re.match(r"^\S.*:$", line):
            section = None
            continue
        content = stripped if stripped.startswith(("│", "┃")) else line
        content = content.lstrip("│┃").rstrip().rstrip("│┃").rstrip()
        if not content.strip():
            continue
        indent = len(content) - len(content.lstrip())
        if section == -1:
            section = indent
        if indent == section:
            token = content.split()[0]
            if re.fullmatch(r"[A-Za-z][\w-]*", token) and token not in names:
                names.append(token)
    if not names:
        for group in re.findall(r"\{([\w,-]+)\}", text):
            names.extend(name for name in group.split(",") if name not in names)
    return names


def heavy_imports(program: list[str], args: list[str], scratch: Path) -> list[str] | str:
    """Which of HEAVY the command imports (or why that could not be told)."""
    record = scratch / "modules.json"
    record.unlink(missing_ok=True)
    done = subprocess.run([PYTHON, "-c", PROBE, program[0], str(record), *args], capture_output=True, text=True)
    if not record.is_file():
        return f"probe failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    roots = set(json.loads(record.read_text()))
    return [name for name in HEAVY if name in roots]


def importtime(top: int) -> None:
    """The heaviest packages behind ``import bertology.cli``: time spent in each package's own modules
    (self time, summed), the cumulative time of its heaviest outermost import (nested packages
    included), and the bertology module under which that import happened."""
    done = subprocess.run([PYTHON, "-X", "importtime", "-c", "import bertology.cli"], capture_output=True, text=True)
    entries = []  # (depth, name, self_us, cumulative_us), in the order Python prints them (children first)
    for line in done.stderr.splitlines():
        match = re.match(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|( *)(\S+)$", line)
        if match:
            entries.append((len(match.group(3)) // 2, match.group(4), int(match.group(1)), int(match.group(2))))
    if not entries:
        print(f"-X importtime gave nothing (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    parent = [None] * len(entries)
    waiting: dict[int, list[int]] = {}  # depth -> entries printed before their parent
    for position, (depth, *_rest) in enumerate(entries):
        for child in waiting.pop(depth + 1, []):
            parent[child] = position
        waiting.setdefault(depth, []).append(position)
    own: dict[str, int] = {}
    heaviest: dict[str, tuple[int, str]] = {}
    for position, (depth, name, self_us, cumulative_us) in enumerate(entries):
        root = name.split(".")[0]
        own[root] = own.get(root, 0) + self_us
        up = parent[position]
        if up is not None and entries[up][1].split(".")[0] == root:
            continue  # not the outermost import of its package
        importer = up
        while importer is not None and not entries[importer][1].startswith("bertology"):
            importer = parent[importer]
        by = entries[importer][1] if importer is not None else "-"
        if root not in heaviest or cumulative_us > heaviest[root][0]:
            heaviest[root] = (cumulative_us, by)
    total = max(cumulative for depth, _, _, cumulative in entries if depth == 0)
    print(f"\nimport bertology.cli: {total / 1e6:.2f} s (python -X importtime; exit {done.returncode})")
    print(f"{'package':<22} {'own s':>7} {'cumulative s':>13}  imported under")
    for root, self_us in sorted(own.items(), key=lambda item: -item[1])[:top]:
        cumulative_us, by = heaviest.get(root, (0, "-"))
        print(f"{root:<22} {self_us / 1e6:7.2f} {cumulative_us / 1e6:13.2f}  {by}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commands", help="comma-separated commands to time (default: every command --help lists)")
    parser.add_argument("--baseline-every", type=int, default=4, help="run the torch import again after this many commands")
    parser.add_argument("--no-modules", action="store_true", help="skip the check of which heavy packages each help imports")
    parser.add_argument("--importtime", action="store_true", help="also list the heaviest packages behind import bertology.cli")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    program = bertology_program()
    print(f"python: {PYTHON}; bertology: {program[0]}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    # warm-up (file cache), untimed; the top-level help also gives the command names
    subprocess.run([PYTHON, "-c", BASELINE], capture_output=True)
    top_help = subprocess.run([*program, "--help"], capture_output=True, text=True)
    if top_help.returncode != 0:
        print(f"bertology --help failed (exit {top_help.returncode}):\n{top_help.stderr.strip()[-2000:]}")
        return 0
    commands = args.commands.split(",") if args.commands else parse_commands(top_help.stdout)
    print(f"commands: {', '.join(commands) or '(none found)'}")
    targets = [["--help"]] + [[command, "--help"] for command in commands]
    label = {tuple(target): "bertology " + " ".join(target) for target in targets}
    baseline_label = f'python -c "{BASELINE}"'

    times: dict[str, list[float]] = {baseline_label: [], **{label[tuple(t)]: [] for t in targets}}
    failures: dict[str, str] = {}
    for round_ in range(args.repeats):
        order = targets if round_ % 2 == 0 else targets[::-1]
        for position, target in enumerate(order):
            if position % max(args.baseline_every, 1) == 0:
                times[baseline_label].append(timed([PYTHON, "-c", BASELINE])[0])
            seconds, done = timed([*program, *target])
            times[label[tuple(target)]].append(seconds)
            if done.returncode != 0:
                failures[label[tuple(target)]] = f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
        times[baseline_label].append(timed([PYTHON, "-c", BASELINE])[0])

    modules: dict[str, list[str] | str] = {}
    if not args.no_modules:
        with tempfile.TemporaryDirectory() as scratch:
            modules[baseline_label] = ["torch"]
            for target in targets:
                modules[label[tuple(target)]] = heavy_imports(program, target, Path(scratch))

    base_best, base_median = min(times[baseline_label]), statistics.median(times[baseline_label])
    width = max(len(name) for name in times)
    print(f"\n{'process':<{width}} {'best s':>7} {'median s':>8} {'best/torch':>10} {'med/torch':>9}  target  heavy imports")
    figures = {"baseline_best_seconds": round(base_best, 3), "baseline_median_seconds": round(base_median, 3), "target_ratio": TARGET, "processes": {}}
    for name, values in times.items():
        best, median = min(values), statistics.median(values)
        ratio_best, ratio_median = best / base_best, median / base_median
        verdict = "-" if name == baseline_label else ("ok" if ratio_median <= TARGET else "over")
        heavy = modules.get(name, "not checked")
        heavy_text = heavy if isinstance(heavy, str) else (", ".join(heavy) or "none")
        print(f"{name:<{width}} {best:7.2f} {median:8.2f} {ratio_best:10.2f} {ratio_median:9.2f}  {verdict:<6}  {heavy_text}")
        figures["processes"][name] = {
            "best_seconds": round(best, 3),
            "median_seconds": round(median, 3),
            "ratio_best": round(ratio_best, 3),
            "ratio_median": round(ratio_median, 3),
            "heavy_imports": heavy,
            **({"failed": failures[name]} if name in failures else {}),
        }
    for name, message in failures.items():
        print(f"note: {name} failed ({message})")
    measured = [entry for name, entry in figures["processes"].items() if name != baseline_label]
    worst = max(measured, key=lambda entry: entry["ratio_median"])
    print(f"\nworst median ratio to the torch import: {worst['ratio_median']:.2f} (target <= {TARGET}); "
          f"helps that import a heavy package: "
          f"{sum(1 for entry in measured if entry['heavy_imports'] and not isinstance(entry['heavy_imports'], str))} of {len(measured)}")
    if args.importtime:
        importtime(args.top)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a measurement, not a test: report and leave with 0
        print(f"cli_help: could not measure: {type(exc).__name__}: {exc}")
    sys.exit(0)
