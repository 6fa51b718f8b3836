"""Do the integrations' defaults hold quality? Dense against sparse for each framework example.

    python experiments/examples/measure_defaults.py [--seeds 0 1 2] [--density 0.05] [--frameworks trainer ...]

For every seed and framework it runs the example twice on 2 gloo ranks under torchrun,
interleaved, with the same seed (initial weights and data order): ``--dense`` (no
sparsecomm) and with the integration at its defaults (only ``--density``). AdamW in all
three (the Trainer's default optimizer; the Lightning and Accelerate examples build it).
It prints each pair's ``final loss`` (the mean training loss over the last quarter of the
steps, both ranks), the difference and the bytes the hook sent as a share of dense
(``state.stats()["compression"]``), then the mean and the largest difference per framework.
The bar: every seed within ``--tolerance`` (0.1, the tolerance the integrations' docs state)
of dense, at under 30% of dense's bytes.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = {  # framework -> (script, its arguments besides --dense/--seed/--density)
    "trainer": ("hf_trainer.py", ["--max-steps", "200", "--eval-steps", "200"]),
    "lightning": ("lightning_ddp.py", []),
    "accelerate": ("accelerate_ddp.py", []),
}
RANK0 = re.compile(r"^rank 0: .*final loss [\d.]+$", re.MULTILINE)
SENT, FINAL = re.compile(r"sent ([\d.]+)% of dense bytes"), re.compile(r"final loss ([\d.]+)")
BYTES_LIMIT = 30.0


def run_example(framework: str, seed: int, density: float | None, dense: bool) -> tuple[float, float | None]:
    """(final loss, percent of dense bytes sent or None for dense) of one 2-rank run."""
    script, arguments = EXAMPLES[framework]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / script), *arguments, "--seed", str(seed)]
    command += ["--dense"] if dense else ([] if density is None else ["--density", str(density)])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE, timeout=1800)
    line = RANK0.search(done.stdout)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    sent = SENT.search(line.group(0))
    return float(FINAL.search(line.group(0)).group(1)), None if sent is None else float(sent.group(1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", choices=sorted(EXAMPLES), default=list(EXAMPLES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--density", type=float, default=None,
                        help="passed to the examples (default: their integration's)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="largest final-loss difference, every seed")
    args = parser.parse_args(argv)
    rows = {framework: [] for framework in args.frameworks}
    print(f"{'framework':<11} {'seed':>4} {'dense':>8} {'sparse':>8} {'diff':>8} {'bytes':>7}", flush=True)
    for seed in args.seeds:  # interleaved: every pair shares the machine's load of its moment
        for framework in args.frameworks:
            dense, _ = run_example(framework, seed, args.density, dense=True)
            sparse, percent = run_example(framework, seed, args.density, dense=False)
            rows[framework].append((dense, sparse, percent))
            print(f"{framework:<11} {seed:>4} {dense:>8.4f} {sparse:>8.4f} {sparse - dense:>+8.4f} {percent:>6.1f}%",
                  flush=True)
    passed = True
    for framework, pairs in rows.items():
        diffs = [s - d for d, s, _ in pairs]
        percent = sum(p for _, _, p in pairs) / len(pairs)
        ok = max(diffs) <= args.tolerance and percent < BYTES_LIMIT
        passed &= ok
        print(f"{framework}: mean diff {sum(diffs) / len(diffs):+.4f}, largest {max(diffs):+.4f} over {len(pairs)} "
              f"seed(s), {percent:.1f}% of dense bytes: {'within' if ok else 'NOT within'} {args.tolerance} at every "
              f"seed at under {BYTES_LIMIT:.0f}%", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
