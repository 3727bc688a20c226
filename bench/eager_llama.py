#!/usr/bin/env python3
"""PyTorch eager reference for `autotp bench-step` (one process, no parallelism).

The same training step autotp runs, written the way a PyTorch user would:
a Llama (RMSNorm, rotary, GQA attention through scaled_dot_product_attention,
SwiGLU MLP), mean token cross-entropy, backward, gradient clipping at 1.0 and
torch.optim.AdamW (lr 1e-4, weight decay 0.01). Shapes come from autotp's
presets (`--preset llama-small` = hidden 512, 4 layers, GQA 8/4, vocab 8000).
Prints tokens/s and the median step time; --json writes them.

CPU (the comparison of docs/cli.md), unchanged by the CUDA path:
    .venv/bin/python bench/eager_llama.py --threads 2

CUDA (tools/gpu-check runs it beside `autotp bench-step` on the same card):
    python bench/eager_llama.py --device cuda --preset llama-1b --seq-len 2048 \\
        --micro-batch 4 --precision bf16 --json eager.json

Precision (--precision):
  plain     weights and optimizer in --dtype (the CPU default: what it always ran)
  autocast  fp32 weights, forward under torch.autocast(bfloat16), fp32 gradients,
            AdamW(fused=True): what most PyTorch users write; 16 bytes per
            parameter plus autocast's bf16 weight copies
  bf16      bf16 weights and gradients, an fp32 master copy and fp32 moments that
            AdamW(fused=True) updates, the gradients upcast to fp32 one layer at a
            time, the masters copied back into the bf16 weights: autotp's bf16 mixed
            precision (16 bytes per parameter), so the memory and the maths match;
            the CUDA default and what tools/gpu-check compares against
On CUDA the phases are timed with CUDA events: forward (to the loss), backward,
optimizer (clipping, the update, the copy back); the optimizer phase is set
against its memory floor, 28 bytes per parameter (the fused update reads the
gradient, reads and writes the master and both moments, writes the weight)
divided by the bandwidth of a large device-to-device copy measured first.
Before building the model the script estimates its memory; where that exceeds
the free device memory (or --memory-limit-gib), or the step runs out of memory,
it writes {"fits": false, "reason": ...} and exits 0.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# autotp's presets (engine/model/presets.cpp); llama-3b is Llama-3.2-3B's shapes.
PRESETS = {
    "llama-small": dict(vocab=8000, hidden=512, inter=1376, layers=4, heads=8, kv=4, tied=False),
    "llama-tiny": dict(vocab=259, hidden=96, inter=202, layers=2, heads=6, kv=2, tied=False),
    "llama-1b": dict(vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv=8, tied=True,
                     rope_theta=500000.0, eps=1e-5),
    "llama-3b": dict(vocab=128256, hidden=3072, inter=8192, layers=28, heads=24, kv=8, tied=True,
                     rope_theta=500000.0, eps=1e-5),
    "llama2-7b": dict(vocab=32000, hidden=4096, inter=11008, layers=32, heads=32, kv=32, tied=False,
                      rope_theta=10000.0, eps=1e-5),
}
GIB = 2**30
# Bytes per parameter the fused AdamW update moves with bf16 weights and gradients and
# fp32 masters and moments: read the gradient (2), read and write the master (4 + 4),
# both moments (8 + 8), write the bf16 weight (2). autocast's fp32 weights come to the
# same 28 (gradient 4, weight 4 + 4, moments 16).
OPTIMIZER_BYTES_PER_PARAM = 28


class Llama(torch.nn.Module):
    def __init__(self, vocab, hidden, inter, layers, heads, kv, tied, dtype, device="cpu",
                 rope_theta=10000.0, eps=1e-6):
        super().__init__()
        self.heads, self.kv, self.dim = heads, kv, hidden // heads
        self.rope_theta, self.eps = rope_theta, eps

        # Drawn on the device: a 7 B model drawn on the host and copied over takes minutes.
        def linear(i, o):
            return torch.nn.Parameter(torch.randn(o, i, dtype=dtype, device=device) * 0.02)

        def ones(n):
            return torch.nn.Parameter(torch.ones(n, dtype=dtype, device=device))

        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype, device=device) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.ln1 = ones(hidden)
            b.q, b.k, b.v = linear(hidden, hidden), linear(hidden, kv * self.dim), linear(hidden, kv * self.dim)
            b.o = linear(hidden, hidden)
            b.ln2 = ones(hidden)
            b.gate, b.up, b.down = linear(hidden, inter), linear(hidden, inter), linear(inter, hidden)
            self.blocks.append(b)
        self.norm = ones(hidden)
        self.head = None if tied else linear(hidden, vocab)

    def rms(self, x, w):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, ids):
        B, T = ids.shape
        D = self.dim
        dev = ids.device
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=dev) / D))
        freqs = torch.outer(torch.arange(T, dtype=torch.float32, device=dev), inv)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
        x = F.embedding(ids, self.embed)
        # On CUDA, SDPA reads the shared kv heads itself (enable_gqa, as autotp does there);
        # on CPU the heads are expanded first (faster there, and what the CPU figures used).
        gqa = ids.is_cuda and self.heads != self.kv

        def rotate(t):
            # cos / sin in t's dtype: under autocast t is bf16 and the rotation stays bf16.
            c, s = cos.to(t.dtype), sin.to(t.dtype)
            a, b = t.chunk(2, -1)
            return t * c + torch.cat([-b, a], -1) * s

        for b in self.blocks:
            h = self.rms(x, b.ln1)
            q = F.linear(h, b.q).view(B, T, self.heads, D).transpose(1, 2)
            k = F.linear(h, b.k).view(B, T, self.kv, D).transpose(1, 2)
            v = F.linear(h, b.v).view(B, T, self.kv, D).transpose(1, 2)
            q, k = rotate(q), rotate(k)
            if gqa:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                rep = self.heads // self.kv
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, -1), b.o)
            h = self.rms(x, b.ln2)
            x = x + F.linear(F.silu(F.linear(h, b.gate)) * F.linear(h, b.up), b.down)
        x = self.rms(x, self.norm)
        return F.linear(x, self.embed if self.head is None else self.head)


def shapes(args):
    cfg = dict(PRESETS[args.preset])
    if args.layers:
        cfg["layers"] = args.layers
    return cfg


def count_parameters(cfg):
    h, i, kvd = cfg["hidden"], cfg["inter"], cfg["kv"] * (cfg["hidden"] // cfg["heads"])
    per_layer = 2 * h * h + 2 * h * kvd + 3 * h * i + 2 * h
    embeddings = cfg["vocab"] * h * (1 if cfg["tied"] else 2)
    return cfg["layers"] * per_layer + embeddings + h


def matmul_weights(cfg):
    """Elements of every matmul weight a token passes, the LM head included (tied or not)."""
    h, i, kvd = cfg["hidden"], cfg["inter"], cfg["kv"] * (cfg["hidden"] // cfg["heads"])
    return cfg["layers"] * (2 * h * h + 2 * h * kvd + 3 * h * i) + cfg["vocab"] * h


def model_flops_per_step(cfg, micro_batch, seq_len):
    # autotp's definition (bench/README.md): tokens x 3 x (2 x matmul weights + 4 x S x Hq x D x layers).
    tokens = micro_batch * seq_len
    return tokens * 3 * (2 * matmul_weights(cfg) + 4 * seq_len * cfg["hidden"] * cfg["layers"])


def estimate_memory(cfg, precision, micro_batch, seq_len, param_bytes):
    """Rough peak of one step in bytes: model states, saved activations, logits.

    Model states: autocast 4 (weight) + 4 (gradient) + 8 (moments) + 2 (autocast's bf16
    weight copies) per parameter; bf16 2 + 2 + 4 (master) + 8, plus one layer's fp32
    gradient copy; plain param_bytes x 4 (weight, gradient, two moments).
    Activations per token and layer: about 9 hidden-wide and 4 intermediate-wide tensors
    in the activation dtype plus 2 hidden-wide fp32 norm temporaries (autocast keeps the
    residual stream in fp32: 4 more hidden-wide fp32 tensors). Logits: the activation
    dtype's copy, the fp32 copy and its gradient per token and vocabulary entry.
    """
    p = count_parameters(cfg)
    h, i, layers, vocab = cfg["hidden"], cfg["inter"], cfg["layers"], cfg["vocab"]
    tokens = micro_batch * seq_len
    kvd = cfg["kv"] * (h // cfg["heads"])
    largest_layer = 2 * h * h + 2 * h * kvd + 3 * h * i
    if precision == "autocast":
        states, act, extra = 18 * p, 2, 4 * 4 * h
    elif precision == "bf16":
        states, act, extra = 16 * p + 4 * max(largest_layer, vocab * h), 2, 0
    else:
        states, act, extra = 4 * param_bytes * p, param_bytes, 0
    per_token_layer = act * (9 * h + 4 * i) + 2 * 4 * h + extra
    activations = tokens * layers * per_token_layer
    logits = tokens * vocab * (act + 4 + 4)
    return int(states + activations + logits)


class MasterAdamW:
    """bf16 weights with fp32 masters: torch.optim.AdamW(fused=True) over the masters.

    The bf16 gradients are upcast into the masters' .grad one group (a layer, or the
    embeddings and the rest) at a time, so at most one group's fp32 gradients exist at
    once, as autotp upcasts its flat gradients chunk by chunk; after the group's update
    its masters are copied back into the bf16 weights.
    """

    def __init__(self, groups, lr, weight_decay, fused):
        self.groups = groups
        self.masters = [[p.detach().float().requires_grad_(True) for p in g] for g in groups]
        self.opt = torch.optim.AdamW([m for g in self.masters for m in g], lr=lr, weight_decay=weight_decay,
                                     fused=fused)

    @torch.no_grad()
    def step(self):
        for params, masters in zip(self.groups, self.masters):
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
            self.opt.step()  # only the masters holding a .grad take a step
            for p, m in zip(params, masters):
                p.copy_(m)
                m.grad = None


def parameter_groups(model):
    groups = [list(b.parameters()) for b in model.blocks]
    rest = [model.embed, model.norm] + ([model.head] if model.head is not None else [])
    return groups + [rest]


def measure_copy_bandwidth(device, nbytes):
    """Bytes per second moved by a device-to-device copy (read + write), best of 10."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(12):
        t = timed(device, lambda: dst.copy_(src))
        if i >= 2:
            best = min(best, t)
    del src, dst
    return 2 * nbytes / best


def measure_gemm_tflops(device, n, dtype):
    """A square n^3 GEMM in dtype, best of 10 (autotp's bench-step measures 8192^3 in bf16)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for i in range(12):
        t = timed(device, lambda: torch.mm(a, b))
        if i >= 2:
            best = min(best, t)
    del a, b
    return 2 * n**3 / best / 1e12


def timed(device, fn):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class PhaseClock:
    """Marks phase boundaries: CUDA events on a GPU (read after the step's sync), else host time."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def phases(self):
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def write_json(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count (dry runs)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", choices=["plain", "autocast", "bf16"],
                   help="plain (weights in --dtype), autocast or bf16 (see above); default: plain on cpu, bf16 on cuda")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"], help="weights with --precision plain")
    p.add_argument("--memory-limit-gib", type=float, default=0,
                   help="memory the fit check allows (default: free device memory; none on cpu)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--fused-adamw", action="store_true",
                   help="with --precision plain: AdamW(fused=True) instead of torch's default AdamW")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, profile one more step (torch.profiler) and print the N ops "
                        "with the most self time")
    return p.parse_args()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("eager_llama.py: --device cuda but torch sees no GPU")
    precision = args.precision or ("bf16" if device.type == "cuda" else "plain")
    cuda = device.type == "cuda"
    cfg = shapes(args)
    params = count_parameters(cfg)
    plain_dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    label = args.dtype if precision == "plain" else precision
    name = f"eager/{args.preset}/{label}" + ("/cuda" if cuda else "")
    tokens = args.micro_batch * args.seq_len
    result = {"name": name, "torch": torch.__version__, "device": args.device, "precision": precision,
              "preset": args.preset, "shapes": cfg, "parameters": params,
              "micro_batch": args.micro_batch, "seq_len": args.seq_len, "warmup": args.warmup,
              "steps": args.steps, "tokens_per_step": tokens}
    if not cuda:
        result["threads"] = torch.get_num_threads()

    # Fit check before anything is allocated.
    estimate = estimate_memory(cfg, precision, args.micro_batch, args.seq_len, 4 if plain_dtype == torch.float32 else 2)
    result["memory_estimate_bytes"] = estimate
    limit = args.memory_limit_gib * GIB if args.memory_limit_gib else None
    if cuda:
        free, total = torch.cuda.mem_get_info()
        result.update(device_name=torch.cuda.get_device_name(), free_bytes_at_start=free, total_bytes=total)
        limit = limit or free
    if limit is not None and estimate > limit:
        result.update(fits=False, reason=f"needs about {estimate / GIB:.1f} GiB ({precision}, {params / 1e9:.2f} B "
                      f"parameters, micro-batch {args.micro_batch} x {args.seq_len}), {limit / GIB:.1f} GiB available")
        print(f"eager {args.preset} {precision}: does not fit: {result['reason']}")
        write_json(args.json, result)
        return

    # The card's limits, measured before the model takes the memory.
    result["copy_bandwidth_Bps"] = measure_copy_bandwidth(device, GIB if cuda else 64 * 2**20)
    if cuda:
        result["gemm_tflops"] = measure_gemm_tflops(device, 8192, torch.bfloat16)
        torch.cuda.empty_cache()

    torch.manual_seed(1)
    weight_dtype = {"plain": plain_dtype, "autocast": torch.float32, "bf16": torch.bfloat16}[precision]
    fused = cuda or precision != "plain" or args.fused_adamw  # the CPU default keeps the optimizer it always used
    try:
        model = Llama(**cfg, dtype=weight_dtype, device=device)
        if precision == "bf16":
            opt = MasterAdamW(parameter_groups(model), lr=1e-4, weight_decay=0.01, fused=fused)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused or None)
        step_times, phases, loss = run_steps(model, opt, cfg, args, device, precision)
        if args.profile:
            print_profile(model, opt, cfg, args, device, precision)
    except torch.OutOfMemoryError as e:
        result.update(fits=False, reason="out of memory: " + str(e).splitlines()[0][:300])
        if cuda:
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        print(f"eager {args.preset} {precision}: does not fit: {result['reason']}")
        write_json(args.json, result)
        return

    median = statistics.median(step_times)
    fwd, bwd, optim = (statistics.median(p[i] for p in phases) for i in range(3))
    floor = OPTIMIZER_BYTES_PER_PARAM * params / result["copy_bandwidth_Bps"]
    flops = model_flops_per_step(cfg, args.micro_batch, args.seq_len)
    result.update(fits=True, step_time_median_s=median, tokens_per_s=tokens / median, step_times_s=step_times,
                  forward_s=fwd, backward_s=bwd, optimizer_s=optim, phase_timer="cuda events" if cuda else "host",
                  optimizer_bytes_per_param=OPTIMIZER_BYTES_PER_PARAM, optimizer_floor_s=floor,
                  optimizer_over_floor=optim / floor, model_flops_per_step=flops,
                  achieved_tflops=flops / median / 1e12, loss=loss)
    if cuda:
        result.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                      mfu_measured_gemm=flops / median / 1e12 / result["gemm_tflops"])
    where = f"{result['device_name']}" if cuda else f"{torch.get_num_threads()} thread(s)"
    if precision == "plain" and not cuda:
        # The line the CPU comparison has always printed.
        print(f"eager {args.preset} {args.dtype}, torch {torch.__version__}, {where}: "
              f"{tokens / median:.1f} tokens/s, median step {median:.4f} s")
    else:
        print(f"eager {args.preset} {precision} on {args.device}, torch {torch.__version__}, {where}: "
              f"{tokens / median:.1f} tokens/s, median step {median:.4f} s (forward {fwd:.4f}, backward {bwd:.4f}, "
              f"optimizer {optim:.4f} s = {optim / floor:.2f}x its floor {floor:.4f} s)"
              + (f", peak {result['peak_allocated_bytes'] / GIB:.2f} GiB" if cuda else ""))
    write_json(args.json, result)


def print_profile(model, opt, cfg, args, device, precision):
    """One more step under torch.profiler: the ops with the most self time (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    one = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(model, opt, cfg, one, device, precision)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))


def run_steps(model, opt, cfg, args, device, precision):
    """Warm-up then timed steps; returns the timed steps' wall times, their phases and the last loss."""
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
    gen = torch.Generator(device=device).manual_seed(2)
    step_times, phases, loss = [], [], None
    for step in range(args.warmup + args.steps):
        ids = torch.randint(cfg["vocab"], (args.micro_batch, args.seq_len + 1), device=device, generator=gen)
        if cuda:
            torch.cuda.synchronize()
        clock = PhaseClock(device)
        start = time.perf_counter()
        clock.mark()
        with autocast:
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), ids[:, 1:].reshape(-1))
        clock.mark()
        loss.backward()
        clock.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if precision != "bf16":
            opt.zero_grad(set_to_none=True)
        clock.mark()
        if cuda:
            torch.cuda.synchronize()  # the step ends when the GPU is done, as autotp's does
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            step_times.append(elapsed)
            phases.append(clock.phases())
        del logits
    return step_times, phases, loss.item()


if __name__ == "__main__":
    main()
