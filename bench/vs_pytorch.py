#!/usr/bin/env python3
"""autotp against PyTorch eager, side by side in one run (`tools/bench --vs-pytorch` runs it).

For each round (default 3) and precision (fp32, bf16) it runs, one after the other:
`autotp bench-step` at tp 1 (1 rank x 2 threads) and tp 2 (2 ranks x 1 thread), and
`bench/eager_llama.py` at each of --pytorch-threads (fp32: `--precision plain
--fused-adamw`; bf16: `--precision autocast` and `--precision bf16`). Reports the
median tokens/s of the rounds, autotp / PyTorch (PyTorch at its best thread
setting, the best median of the thread counts tried), and per autotp run the
forward + backward's share of the measured GEMM rate of its dtype and the
optimizer phase over its memory-bandwidth floor (bench/README.md defines both).

    .venv/bin/python bench/vs_pytorch.py --autotp build/autotp --out DIR [--rounds 3] [--steps 5]

Writes DIR/vs-pytorch.json (benchmark JSON: one row per autotp layout and precision,
one per PyTorch recipe) and DIR/vs-pytorch.txt (the table).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Bytes per parameter of the optimizer phase's floor (bench/README.md): read the gradient,
# read and write the (master) weight and both moments, write the bf16 weight; 28 in fp32 too.
OPTIMIZER_BYTES_PER_PARAM = 28
AUTOTP_LAYOUTS = [("tp1", ["--nproc", "1", "--threads", "2"], "1 rank x 2 threads"),
                  ("tp2", ["--nproc", "2", "--tp", "2", "--threads", "1"], "2 ranks x 1 thread")]
# PyTorch recipes per autotp dtype; the first one is the ratio's reference.
PYTORCH_RECIPES = {"f32": [("eager-fp32", ["--precision", "plain", "--fused-adamw"])],
                   "bf16": [("autocast-bf16", ["--precision", "autocast"]),
                            ("bf16-master", ["--precision", "bf16"])]}


def run_json(cmd, path):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        data = json.load(f)
    return data["benchmarks"][0] if "benchmarks" in data else data


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--autotp", default=os.path.join(ROOT, "build", "autotp"))
    p.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--pytorch-threads", default="2", help="comma list of torch thread counts to try")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtypes = args.dtypes.split(",")
    threads = [int(t) for t in args.pytorch_threads.split(",")]
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs = {}  # key -> list of rows (one per round)
    for rnd in range(args.rounds):
        for dtype in dtypes:
            for name, flags, _ in AUTOTP_LAYOUTS:
                path = os.path.join(args.out, f"raw-autotp-{dtype}-{name}-r{rnd}.json")
                cmd = [args.autotp, "bench-step", "--model", "preset:llama-small", "--dtype", dtype,
                       "--json", path] + flags + common
                runs.setdefault(("autotp", dtype, name), []).append(run_json(cmd, path))
            for recipe, flags in PYTORCH_RECIPES[dtype]:
                for t in threads:
                    path = os.path.join(args.out, f"raw-eager-{recipe}-{t}t-r{rnd}.json")
                    cmd = [args.python, os.path.join(ROOT, "bench", "eager_llama.py"), "--threads", str(t),
                           "--json", path] + flags + common
                    runs.setdefault(("eager", recipe, t), []).append(run_json(cmd, path))

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    # PyTorch's best thread setting per recipe, and the machine's copy bandwidth (eager measures it).
    best = {}
    for dtype in dtypes:
        for recipe, _ in PYTORCH_RECIPES[dtype]:
            t = max(threads, key=lambda t: med(runs[("eager", recipe, t)], "tokens_per_s"))
            best[recipe] = (t, runs[("eager", recipe, t)])
    bandwidth = statistics.median(r["copy_bandwidth_Bps"] for rows in best.values() for r in rows[1])
    parameters = next(iter(best.values()))[1][0]["parameters"]
    floor_s = OPTIMIZER_BYTES_PER_PARAM * parameters / bandwidth

    rows, lines = [], []
    lines.append(f"autotp vs PyTorch {next(iter(best.values()))[1][0]['torch']} eager, llama-small, micro-batch 4 x 256, "
                 f"{args.rounds} rounds interleaved (medians), {args.steps} steps each")
    lines.append(f"{'dtype':<5} {'autotp layout':<24} {'autotp tok/s':>12} {'PyTorch recipe':<22} {'tok/s':>8} "
                 f"{'ratio':>6} {'rounds':<18} {'fwd+bwd/GEMM':>12} {'optim/floor':>11}")
    for dtype in dtypes:
        reference, _ = PYTORCH_RECIPES[dtype][0]
        t_ref, ref_rows = best[reference]
        ref_tps = med(ref_rows, "tokens_per_s")
        for name, _, layout in AUTOTP_LAYOUTS:
            a_rows = runs[("autotp", dtype, name)]
            tps = med(a_rows, "tokens_per_s")
            per_round = [a["tokens_per_s"] / e["tokens_per_s"] for a, e in zip(a_rows, ref_rows)]
            fb_share = med(a_rows, "model_flops_per_step") / med(a_rows, "forward_backward_s") / \
                med(a_rows, "gemm_limit_flops")
            over_floor = med(a_rows, "optimizer_s") / floor_s
            lines.append(f"{dtype:<5} {name + ' (' + layout + ')':<24} {tps:>12.1f} {reference + f' ({t_ref}t)':<22} "
                         f"{ref_tps:>8.1f} {tps / ref_tps:>5.2f}x {','.join(f'{x:.2f}' for x in per_round):<18} "
                         f"{100 * fb_share:>11.1f}% {over_floor:>10.2f}x")
            rows.append({"name": f"vs-pytorch/{dtype}/{name}", "autotp_tokens_per_s": tps, "layout": layout,
                         "pytorch_recipe": reference, "pytorch_threads": t_ref, "pytorch_tokens_per_s": ref_tps,
                         "ratio": tps / ref_tps, "ratio_per_round": per_round,
                         "autotp_tokens_per_s_rounds": [a["tokens_per_s"] for a in a_rows],
                         "forward_backward_s": med(a_rows, "forward_backward_s"),
                         "optimizer_s": med(a_rows, "optimizer_s"),
                         "gemm_limit_flops": med(a_rows, "gemm_limit_flops"),
                         "forward_backward_gemm_share": fb_share, "optimizer_floor_s": floor_s,
                         "optimizer_over_floor": over_floor, "higher_is_better": "ratio"})
        for recipe, _ in PYTORCH_RECIPES[dtype]:
            t, e_rows = best[recipe]
            rows.append({"name": f"vs-pytorch/eager/{recipe}", "tokens_per_s": med(e_rows, "tokens_per_s"),
                         "threads": t, "tokens_per_s_rounds": [e["tokens_per_s"] for e in e_rows],
                         "forward_s": med(e_rows, "forward_s"), "backward_s": med(e_rows, "backward_s"),
                         "optimizer_s": med(e_rows, "optimizer_s"),
                         "optimizer_over_floor": med(e_rows, "optimizer_s") / floor_s,
                         "higher_is_better": "tokens_per_s"})
            if recipe != reference:
                lines.append(f"{'':<5} {'':<24} {'':>12} {recipe + f' ({t}t)':<22} "
                             f"{med(e_rows, 'tokens_per_s'):>8.1f}")
    lines.append(f"optimizer floor {floor_s:.4f} s = {OPTIMIZER_BYTES_PER_PARAM} B x {parameters} parameters / "
                 f"{bandwidth / 1e9:.1f} GB/s copy bandwidth (eager_llama.py's, median)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(os.path.join(args.out, "vs-pytorch.txt"), "w") as f:
        f.write(text)
    context = {"benchmark": "vs-pytorch", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "host_name": platform.node(), "num_cpus": os.cpu_count(), "rounds": args.rounds,
               "steps": args.steps, "pytorch_threads_tried": threads}
    with open(os.path.join(args.out, "vs-pytorch.json"), "w") as f:
        json.dump({"context": context, "benchmarks": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
