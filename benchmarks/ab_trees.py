"""Two fastwan trees timed against each other in one run, on the same weights: each tree in its own worker
process (:file:`benchmarks/ab_worker.py`, run by path with that tree first on PYTHONPATH), both built and warmed
up first, then timed in interleaved rounds (A B A B ...) so clock drift hits both alike.

  python -m benchmarks.ab_trees --job e2e --tree old=/tmp/old --tree new=. --rounds 2 --out ab_e2e.json
  python -m benchmarks.ab_trees --job forward14b --tree old=/tmp/old --tree new=. --sequential --out ab_14b.json

``--sequential`` builds, times and ends one worker at a time (jobs whose two copies do not fit in memory
together), round after round. e2e also reports the PSNR of each tree's frames against the first tree's.
``--dry-run`` (CI, no GPU): the arguments checked and each tree's worker command listed, nothing started.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import add_dry_run, print_plan

WORKER = Path(__file__).with_name("ab_worker.py")


class Worker:
    def __init__(self, label: str, tree: str, args: list[str]):
        path = os.pathsep.join([str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self.label = label
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker {self.label} ended (exit {self.proc.wait()})")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_trees", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", choices=("e2e", "forward14b"), required=True)
    p.add_argument("--tree", action="append", required=True, help="LABEL=PATH, twice or more")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sequential", action="store_true")
    p.add_argument("--ckpt", default="/tmp/wan13b")
    p.add_argument("--workdir", default="/tmp/ab")
    p.add_argument("--out", default="ab.json")
    p.add_argument("worker_args", nargs="*", help="after --: more arguments for the workers")
    add_dry_run(p)
    a = p.parse_args(argv)
    if any("=" not in t for t in a.tree) or len(a.tree) < 2:
        p.error(f"--tree {a.tree}: give LABEL=PATH at least twice, e.g. --tree old=../old --tree new=.")
    trees = dict(t.split("=", 1) for t in a.tree)

    def args(label):
        extra = ["--frames", f"{a.workdir}/{label}"] if a.job == "e2e" else []
        return ["--job", a.job, "--ckpt", a.ckpt, *extra, *a.worker_args]

    if a.dry_run:
        return print_plan(p.prog, [f"{label}: PYTHONPATH={Path(tree).resolve()} {WORKER.name} {' '.join(args(label))}"
                                   f", {a.rounds} round(s){', alone' if a.sequential else ''}"
                                   for label, tree in trees.items()])
    Path(a.workdir).mkdir(parents=True, exist_ok=True)

    res = {"command": " ".join([p.prog, *(sys.argv[1:] if argv is None else argv)]), "trees": trees, "setup": {},
           "runs": {label: [] for label in trees}}
    workers = {}
    if not a.sequential:
        workers = {label: Worker(label, tree, args(label)) for label, tree in trees.items()}
        for label, w in workers.items():
            res["setup"][label] = w.answer()
            print(label, res["setup"][label], flush=True)
    for r in range(a.rounds):
        for label, tree in trees.items():
            w = workers.get(label)
            if w is None:
                w = Worker(label, tree, args(label))
                res["setup"][f"{label}_{r}"] = w.answer()
            out = w.run()
            res["runs"][label].append(out)
            print(f"round {r} {label}: {out}", flush=True)
            if a.sequential:
                w.close()
    for w in workers.values():
        w.close()
    key = "s" if a.job == "e2e" else "ms"
    labels = list(trees)
    print(f"\n{'tree':<8} {'median':>10} {'min-max':>21} {'vs ' + labels[0]:>10}")
    base = statistics.median(r[key] for r in res["runs"][labels[0]])
    for label in labels:
        vals = [r[key] for r in res["runs"][label]]
        med = statistics.median(vals)
        res.setdefault("median", {})[label] = med
        print(f"{label:<8} {med:10.2f} {min(vals):10.2f}-{max(vals):<10.2f} {(med / base - 1) * 100:+9.2f}%")
    if a.job == "e2e":
        import numpy as np

        first = np.load(f"{a.workdir}/{labels[0]}_0.npy")
        for label in labels:
            for i in range(a.rounds):
                res.setdefault("psnr_vs_first", {})[f"{label}_{i}"] = psnr(np.load(f"{a.workdir}/{label}_{i}.npy"),
                                                                           first)
        print("PSNR vs", labels[0], "run 0:", {k: f"{v:.2f}" for k, v in res["psnr_vs_first"].items()})
    else:
        for label in labels:
            print(label, "rel err vs diffusers:", res["runs"][label][0]["rel_err_vs_diffusers"])
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
