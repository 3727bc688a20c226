#!/usr/bin/python3
"""Draws the demo's training comparison from metrics JSONL files.

usage: plot_training.py OUT_DIR NAME=METRICS.jsonl ...
Writes OUT_DIR/loss.png, OUT_DIR/memory.png and prints a Markdown table.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    out = sys.argv[1]
    runs = []
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        runs.append((name, load(path)))
    base_name, base = runs[0]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, rows in runs:
        steps = [r["step"] for r in rows]
        top.plot(steps, [r["loss"] for r in rows], label=name, marker="o", markersize=3)
        bottom.plot(steps, [r["loss"] - b["loss"] for r, b in zip(rows, base)], label=name)
    top.set_ylabel("loss (mean token cross-entropy)")
    top.set_title("Training loss by layout")
    top.legend()
    bottom.set_ylabel(f"loss - {base_name}")
    bottom.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(f"{out}/loss.png", dpi=110)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    kinds = ["params", "grads", "master_weights", "optimizer_states"]
    names = [n for n, _ in runs]
    bottoms = [0.0] * len(runs)
    for kind in kinds:
        values = [rows[-1]["memory"]["model_states"][kind] / 2**20 for _, rows in runs]
        ax.bar(names, values, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    analytic = [rows[-1]["memory"]["model_states_analytic"]["total"] / 2**20 for _, rows in runs]
    ax.scatter(names, analytic, color="black", marker="_", s=600, label="analytic total", zorder=3)
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title("Model-state memory per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/memory.png", dpi=110)

    print("| layout | final loss | max abs loss diff vs " + base_name + " | median step time (s) | tokens/s | model states rank 0 (MiB) | analytic (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in runs:
        diff = max(abs(r["loss"] - b["loss"]) for r, b in zip(rows, base))
        times = sorted(r["step_time_s"] for r in rows[1:] or rows)
        median = times[len(times) // 2]
        tps = sorted(r["tokens_per_s"] for r in rows[1:] or rows)[len(times) // 2]
        ms = rows[-1]["memory"]["model_states"]["total"] / 2**20
        an = rows[-1]["memory"]["model_states_analytic"]["total"] / 2**20
        print(f"| {name} | {rows[-1]['loss']:.4f} | {diff:.2e} | {median:.3f} | {tps:.0f} | {ms:.2f} | {an:.2f} |")


if __name__ == "__main__":
    main()
