"""Does the torchtitan integration hold quality? torchtitan's own HSDP against the hook, paired.

    python experiments/examples/measure_torchtitan.py [--seeds 0 1 2] [--steps 200] [--nproc 4]
        [--density 0.035 --index-codec rice --value-codec int2] [--out DIR]

For every seed it runs ``torchtitan_hsdp.py`` (torchtitan's llama3 debug model, 2 replicas:
2x2 on 4 processes) twice under torchrun with the same ``--debug.seed`` (initial weights;
the data order is the data loader's, the same in both): without the hook (torchtitan's native
HSDP) and with ``--sparsecomm.enable`` at the given density and codecs (AdamW's momentum moved
into the hook: the integration's default). From torchtitan's own TensorBoard events it reads
``loss_metrics/global_avg_loss`` (the training loss over all ranks) at every step, and reports
the final loss (the mean over the last quarter of the steps), the difference per seed and the
hook's bytes across replicas as a share of dense (``sparsecomm/bytes_sent_per_step`` over
``sparsecomm/bytes_dense_per_step``), over the whole run and over the last quarter. The bar: every seed within
``--tolerance`` (0.1, the tolerance the integrations' docs state) of dense.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # experiments/cpu_info.py
LOSS = "loss_metrics/global_avg_loss"


def scalars(dump: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in dump.glob("tb/*/events.out.tfevents.*")}
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    return [event.value for event in sorted(reader.Scalars(tag), key=lambda e: e.step)]


def run(args, seed: int, sparse: bool) -> dict:
    dump = args.out / f"{'sparse' if sparse else 'dense'}-seed{seed}"
    shutil.rmtree(dump, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(HERE / "torchtitan_hsdp.py"), "--training.steps", str(args.steps), "--debug.seed", str(seed),
               "--dump_folder", str(dump), "--metrics.enable_tensorboard", "--metrics.log_freq", "1"]
    if sparse:
        command += ["--sparsecomm.enable", "--sparsecomm.density", str(args.density),
                    "--sparsecomm.index_codec", args.index_codec, "--sparsecomm.value_codec", args.value_codec]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=3600)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    losses = scalars(dump, LOSS)
    tail = losses[-max(1, len(losses) // 4):]
    result = {"final": sum(tail) / len(tail), "seconds": time.perf_counter() - began}
    if sparse:
        sent, dense = scalars(dump, "sparsecomm/bytes_sent_per_step"), scalars(dump, "sparsecomm/bytes_dense_per_step")
        result["share"] = sum(sent[-len(tail):]) / sum(dense[-len(tail):])
        result["share_whole"] = sum(sent) / sum(dense)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=4, help="processes (2 replicas x nproc/2 shards; default 4)")
    parser.add_argument("--density", type=float, default=0.035)
    parser.add_argument("--index-codec", default="rice")
    parser.add_argument("--value-codec", default="int2")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=Path("runs/torchtitan-quality"))
    args = parser.parse_args(argv)
    from cpu_info import describe_cpu

    print(f"{describe_cpu()}; torchtitan llama3 debugmodel, "
          f"2 replicas x {args.nproc // 2} shards, {args.steps} steps, sparse: density {args.density}, "
          f"{args.index_codec} + {args.value_codec}", flush=True)
    print("| seed | dense final loss | sparse final loss | sparse - dense | bytes vs dense (whole run / last quarter) | "
          "seconds dense / sparse |\n|---|---|---|---|---|---|", flush=True)
    gaps = []
    for seed in args.seeds:
        dense, sparse = run(args, seed, False), run(args, seed, True)
        gaps.append(sparse["final"] - dense["final"])
        shares = f"{sparse['share_whole']:.2%} / {sparse['share']:.2%}"
        print(f"| {seed} | {dense['final']:.4f} | {sparse['final']:.4f} | {gaps[-1]:+.4f} | {shares} | "
              f"{dense['seconds']:.0f} / {sparse['seconds']:.0f} |", flush=True)
    held = all(gap <= args.tolerance for gap in gaps)
    print(f"mean {sum(gaps) / len(gaps):+.4f}, largest {max(gaps):+.4f}: every seed within {args.tolerance}: "
          f"{'yes' if held else 'no'}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
