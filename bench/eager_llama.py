#!/usr/bin/env python3
"""PyTorch eager reference for `autotp bench-step` (one process, no parallelism).

The same training step autotp runs, written the way a PyTorch user would:
a Llama (RMSNorm, rotary, GQA attention through scaled_dot_product_attention,
SwiGLU MLP), mean token cross-entropy, backward, gradient clipping at 1.0 and
torch.optim.AdamW (lr 1e-4, weight decay 0.01). Shapes come from autotp's
presets (`--preset llama-small` = hidden 512, 4 layers, GQA 8/4, vocab 8000).
Prints tokens/s and the median step time; --json writes them.

Run with the checkout's torch: .venv/bin/python bench/eager_llama.py --threads 2
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

PRESETS = {
    "llama-small": dict(vocab=8000, hidden=512, inter=1376, layers=4, heads=8, kv=4, tied=False),
    "llama-tiny": dict(vocab=259, hidden=96, inter=202, layers=2, heads=6, kv=2, tied=False),
}


class Llama(torch.nn.Module):
    def __init__(self, vocab, hidden, inter, layers, heads, kv, tied, dtype):
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, hidden // heads

        def linear(i, o):
            return torch.nn.Parameter(torch.randn(o, i, dtype=dtype) * 0.02)

        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.ln1 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
            b.q, b.k, b.v = linear(hidden, hidden), linear(hidden, kv * self.dim), linear(hidden, kv * self.dim)
            b.o = linear(hidden, hidden)
            b.ln2 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
            b.gate, b.up, b.down = linear(hidden, inter), linear(hidden, inter), linear(inter, hidden)
            self.blocks.append(b)
        self.norm = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.head = None if tied else linear(hidden, vocab)

    @staticmethod
    def rms(x, w, eps=1e-6):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def forward(self, ids):
        B, T = ids.shape
        D = self.dim
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], -1)
        x = F.embedding(ids, self.embed)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rotate(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat([-b, a], -1) * sin

        for b in self.blocks:
            h = self.rms(x, b.ln1)
            q = F.linear(h, b.q).view(B, T, self.heads, D).transpose(1, 2)
            k = F.linear(h, b.k).view(B, T, self.kv, D).transpose(1, 2)
            v = F.linear(h, b.v).view(B, T, self.kv, D).transpose(1, 2)
            q, k = rotate(q), rotate(k)
            rep = self.heads // self.kv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, -1), b.o)
            h = self.rms(x, b.ln2)
            x = x + F.linear(F.silu(F.linear(h, b.gate)) * F.linear(h, b.up), b.down)
        x = self.rms(x, self.norm)
        return F.linear(x, self.embed if self.head is None else self.head)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-small", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    cfg = PRESETS[args.preset]
    model = Llama(**cfg, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(cfg["vocab"], (args.micro_batch, args.seq_len + 1))
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens = args.micro_batch * args.seq_len
    result = {"name": f"eager/{args.preset}/{args.dtype}", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "micro_batch": args.micro_batch, "seq_len": args.seq_len,
              "step_time_median_s": median, "tokens_per_s": tokens / median, "step_times_s": times}
    print(f"eager {args.preset} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} thread(s): "
          f"{tokens / median:.1f} tokens/s, median step {median:.4f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
