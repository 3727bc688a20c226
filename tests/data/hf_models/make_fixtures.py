#!/usr/bin/env python3
"""Provenance script for the HuggingFace reference fixtures in this directory.

Each fixture directory `<arch>_<generation>/` holds what `model.save_pretrained()` of the named
transformers release writes (config.json, model.safetensors, generation_config.json) for a tiny
randomly initialised model, plus `reference.safetensors` with HF's own fp32 eager forward/backward
results (input_ids, logits, loss, [aux_loss, ce_loss], grad.<saved tensor name>).

Run by hand (see README.md):
    /tmp/hfv4/bin/python tests/data/hf_models/make_fixtures.py --generation v4   # transformers 4.57.6
    /tmp/hfv5/bin/python tests/data/hf_models/make_fixtures.py --generation v5   # transformers 5.25.0

Weights do not depend on the transformers release: every tensor of the *saved* checkpoint layout
(which is the same for both releases, see README.md) is drawn from a generator seeded by the
CRC32 of its saved name; the model is then loaded from that checkpoint with `from_pretrained`
(so transformers 5 applies its own load-time conversion, e.g. fusing MoE experts) and re-saved.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file, load_file

VERSIONS = {"v4": "4.57.6", "v5": "5.25.0"}
HERE = os.path.dirname(os.path.abspath(__file__))

VOCAB = 96
BATCH, SEQ = 2, 12
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=32,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    use_cache=False,
)
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.02, num_experts_per_tok=2)


def arch_specs():
    """arch_short -> (config class name, model class name, config kwargs, gemma-style norms)."""
    c = COMMON
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
            c, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}), False),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(c, sliding_window=5, rope_theta=10000.0), False),
        # yarn: v4 derives the factor as max_position_embeddings / original_max_position_embeddings
        # when the latter is given, so keep them consistent (16 / 8 == 2).
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
            c, max_position_embeddings=16, rope_theta=10000.0, use_sliding_window=False,
            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}), False),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
            c, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False), False),
        # Phi3 derives head_dim = hidden_size / num_attention_heads; long factors are used once
        # seq_len > original_max_position_embeddings (12 > 8).
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
            {k: v for k, v in c.items() if k != "head_dim"}, max_position_embeddings=32,
            original_max_position_embeddings=8, rope_theta=10000.0, partial_rotary_factor=1.0,
            resid_pdrop=0.0, embd_pdrop=0.0, rms_norm_eps=1e-5,
            rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0],
                          "long_factor": [1.5, 2.5, 4.0, 6.0]}), False),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
            c, tie_word_embeddings=True, sliding_window=5, attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0, query_pre_attn_scalar=8, hidden_activation="gelu_pytorch_tanh",
            rope_theta=10000.0, layer_types=["sliding_attention", "full_attention"]), True),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            c, tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=8,
            hidden_activation="gelu_pytorch_tanh", rope_theta=1000000.0, rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            layer_types=["sliding_attention", "full_attention"]), True),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
            c, **MOE, intermediate_size=16, num_local_experts=4, sliding_window=None, rope_theta=1000000.0,
            router_jitter_noise=0.0), False),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
            c, **MOE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            num_experts=4, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
            use_sliding_window=False, rope_theta=10000.0), False),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            c, **MOE, intermediate_size=48, moe_intermediate_size=16, num_experts=4, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, use_sliding_window=False, rope_theta=1000000.0), False),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
            vocab_size=VOCAB, n_embd=48, n_head=6, n_layer=2, n_positions=32, n_inner=96,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2, use_cache=False,
            initializer_range=0.02), False),
    }


def is_router(name):
    return name.endswith("mlp.gate.weight") or "block_sparse_moe.gate" in name


# Per-architecture salt for the router weights' seeds, picked (by trying salts 0, 1, 2, ...) so that
# the top-k routing decision of every token has a router-logit margin of at least MIN_ROUTER_MARGIN
# between the k-th and (k+1)-th expert (robust to fp32 rounding differences) and every expert of
# every MoE layer receives at least one token (so every expert gets a non-trivial gradient).
ROUTER_SALT = {"mixtral": 0, "qwen2_moe": 0, "qwen3_moe": 2}
MIN_ROUTER_MARGIN = 1e-2


def init_tensor(name, shape, gemma_norm, router_salt=0):
    """Deterministic, transformers-independent value for the saved tensor `name`."""
    key = name if not (router_salt and is_router(name)) else f"{name}#{router_salt}"
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    base = name.rsplit(".", 1)[0]
    is_norm = len(shape) == 1 and ("norm" in base or ".ln_" in name or name.startswith("transformer.ln_f"))
    z = rng.standard_normal(shape)
    if is_norm and name.endswith("weight"):
        v = 0.1 * z if gemma_norm else 1.0 + 0.1 * z
    elif len(shape) == 1:  # biases
        v = 0.05 * z
    elif is_router(name) or "shared_expert_gate" in name:
        v = 0.3 * z  # routers
    elif "embed" in name or name.startswith("transformer.wte") or name.startswith("transformer.wpe"):
        v = 0.2 * z
    else:
        v = 0.12 * z
    return torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))


def input_ids():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)


def read_st(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def build(arch, cfg_name, model_name, kwargs, gemma_norm, out_dir, router_salt=0):
    cfg_cls = getattr(transformers, cfg_name)
    model_cls = getattr(transformers, model_name)
    cfg = cfg_cls(**kwargs)
    torch.manual_seed(0)
    model = model_cls(cfg).float()
    with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
        # 1. discover the saved layout, 2. overwrite every saved tensor deterministically,
        # 3. reload through from_pretrained (release-specific load conversion), 4. save for real.
        model.save_pretrained(t1, safe_serialization=True)
        saved, meta = read_st(os.path.join(t1, "model.safetensors"))
        new = {k: init_tensor(k, tuple(v.shape), gemma_norm, router_salt) for k, v in saved.items()}
        save_file(new, os.path.join(t1, "model.safetensors"), metadata=meta)
        model = model_cls.from_pretrained(t1, attn_implementation="eager", **dtype_kw())
        model.float()
        loaded_sd = model.state_dict()
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        model.save_pretrained(out_dir, safe_serialization=True)
        resaved, _ = read_st(os.path.join(out_dir, "model.safetensors"))
        assert sorted(resaved) == sorted(new), (arch, sorted(set(resaved) ^ set(new)))
        for k in new:
            assert torch.equal(resaved[k], new[k]), (arch, k)

        # Reference forward/backward, eval() (dropout off) with grad enabled.
        model.eval()
        model.zero_grad(set_to_none=True)
        ids = input_ids()
        fwd_kw = {}
        if getattr(model.config, "output_router_logits", False):
            fwd_kw["output_router_logits"] = True
        out = model(input_ids=ids, labels=ids, **fwd_kw)
        out.loss.backward()
        ref = {
            "input_ids": ids.clone(),
            "logits": out.logits.detach().float().contiguous(),
            "loss": out.loss.detach().float().reshape(()).contiguous(),
        }
        if getattr(out, "aux_loss", None) is not None:
            ref["aux_loss"] = out.aux_loss.detach().float().reshape(()).contiguous()
            ce = model.loss_function(out.logits.detach(), ids, vocab_size=model.config.vocab_size)
            ref["ce_loss"] = ce.detach().float().reshape(()).contiguous()
            margins = router_margins(out.router_logits, model.config)
            print(f"  {arch}: min top-k router logit margin {margins:.4g} (router salt {router_salt})")
            if margins < MIN_ROUTER_MARGIN:
                raise RouterMarginError(margins)
        # Gradients in the saved layout: put each grad into its parameter and let save_pretrained
        # apply the very same (reverse) conversion it applies to the weights.
        with torch.no_grad():
            for n, p in model.named_parameters():
                assert p.grad is not None, (arch, n)  # guaranteed by the router-salt choice
                p.copy_(p.grad)
        model.save_pretrained(t2, safe_serialization=True)
        grads, _ = read_st(os.path.join(t2, "model.safetensors"))
        assert sorted(grads) == sorted(resaved), arch
        for k in sorted(grads):
            assert grads[k].shape == resaved[k].shape
            ref["grad." + k] = grads[k].float().contiguous()
    ref = {k: ref[k] for k in sorted(ref)}
    save_file(ref, os.path.join(out_dir, "reference.safetensors"),
              # a single metadata key: safetensors writes several keys in a random order
              metadata={"info": json.dumps({"transformers_version": transformers.__version__,
                                            "torch_version": torch.__version__, "loss_shape": "[]",
                                            "attn_implementation": "eager", "dtype": "float32"},
                                           sort_keys=True)})
    # 5. verify: reload the saved directory and compare logits.
    m2 = model_cls.from_pretrained(out_dir, attn_implementation="eager", **dtype_kw()).eval()
    with torch.no_grad():
        l2 = m2(input_ids=ids).logits
    d = (l2 - ref["logits"]).abs().max().item()
    print(f"  {arch}: reload max|dlogits| = {d:.3g}, loss = {ref['loss'].item():.6f}, "
          f"max|logit| = {ref['logits'].abs().max().item():.3g}")
    return d


class RouterMarginError(Exception):
    pass


def router_margins(router_logits, cfg):
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and MoE layers;
    0 if some expert of some layer receives no token."""
    k = cfg.num_experts_per_tok
    m = float("inf")
    for rl in router_logits:
        if rl is None:
            continue
        s, idx = rl.detach().float().sort(dim=-1, descending=True)
        m = min(m, (s[:, k - 1] - s[:, k]).min().item())
        if idx[:, :k].unique().numel() != rl.shape[-1]:
            m = 0.0
    return m


def cross_load(other, only):
    """Load `<arch>_<other>` directories with the running release; report the logit mismatch."""
    for arch, (_, model_name, _, _) in arch_specs().items():
        if only and arch not in only:
            continue
        d = os.path.join(HERE, f"{arch}_{other}")
        ref = load_file(os.path.join(d, "reference.safetensors"))
        try:
            m = getattr(transformers, model_name).from_pretrained(d, attn_implementation="eager", **dtype_kw())
            with torch.no_grad():
                lg = m.eval()(input_ids=ref["input_ids"]).logits
            print(f"  {transformers.__version__} loads {arch}_{other}: max|dlogits| "
                  f"{(lg - ref['logits']).abs().max().item():.3g}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {transformers.__version__} loads {arch}_{other}: FAILED {type(e).__name__}: {e}")


def dtype_kw():
    return {"torch_dtype": torch.float32} if transformers.__version__.startswith("4.") else {"dtype": torch.float32}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--generation", required=True, choices=sorted(VERSIONS))
    ap.add_argument("--only", nargs="*", help="architectures to (re)generate (default: all)")
    ap.add_argument("--search-router-salt", action="store_true",
                    help="find the first router salt per MoE arch that passes MIN_ROUTER_MARGIN")
    ap.add_argument("--cross-load", action="store_true",
                    help="only load the OTHER generation's fixtures with this release and compare logits")
    a = ap.parse_args()
    assert transformers.__version__ == VERSIONS[a.generation], (transformers.__version__, a.generation)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    other = "v5" if a.generation == "v4" else "v4"
    if a.cross_load:
        return cross_load(other, a.only)
    report = {}
    for arch, (cfg_name, model_name, kw, gnorm) in arch_specs().items():
        if a.only and arch not in a.only:
            continue
        out_dir = os.path.join(HERE, f"{arch}_{a.generation}")
        print(f"{arch} ({model_name}) -> {out_dir}")
        if a.search_router_salt and arch in ROUTER_SALT:
            for salt in range(1000):
                try:
                    build(arch, cfg_name, model_name, kw, gnorm, out_dir, salt)
                    print(f"  {arch}: router salt {salt} works")
                    break
                except RouterMarginError:
                    pass
            continue
        reload_diff = build(arch, cfg_name, model_name, kw, gnorm, out_dir, ROUTER_SALT.get(arch, 0))
        entry = {"reload_max_abs_logit_diff": reload_diff}
        other_dir = os.path.join(HERE, f"{arch}_{other}")
        if os.path.exists(os.path.join(other_dir, "reference.safetensors")):
            mine = load_file(os.path.join(out_dir, "reference.safetensors"))
            theirs = load_file(os.path.join(other_dir, "reference.safetensors"))
            w_mine = load_file(os.path.join(out_dir, "model.safetensors"))
            w_theirs = load_file(os.path.join(other_dir, "model.safetensors"))
            same_w = sorted(w_mine) == sorted(w_theirs) and all(torch.equal(w_mine[k], w_theirs[k]) for k in w_mine)
            assert sorted(mine) == sorted(theirs), (arch, sorted(set(mine) ^ set(theirs)))
            dl = (mine["logits"] - theirs["logits"]).abs().max().item()
            dloss = (mine["loss"] - theirs["loss"]).abs().max().item()
            dg = max((mine[k] - theirs[k]).abs().max().item() for k in mine if k.startswith("grad."))
            print(f"  {arch}: {a.generation} vs {other}: same weights {same_w}, max|dlogits| {dl:.3g}, "
                  f"|dloss| {dloss:.3g}, max|dgrad| {dg:.3g}")
            assert same_w, arch
            assert dl < 1e-5, (arch, dl)
            entry.update(same_weights=same_w, cross_logits=dl, cross_loss=dloss, cross_grad=dg)
        report[arch] = entry
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
