#!/usr/bin/env python3
"""Provenance script for the HF PEFT LoRA reference fixtures in this directory.

Each fixture directory `<name>/` holds what `PeftModel.save_pretrained()` of PEFT 0.21.2 writes
(adapter_config.json, adapter_model.safetensors; the boilerplate model-card README.md it also
writes is deleted) for a LoRA adapter on one of the tiny transformers-5 base models in
../hf_models/<arch>_v5, plus:

- `reference.safetensors`: PEFT's own fp32 eager forward/backward results (input_ids, labels,
  logits, loss, base_logits, grad.<adapter key>, merged.<base weight name>), see README.md;
- `expected.json`: what PEFT did (wrapped modules, scaling, r, lora_alpha, loss, ...).

Run by hand from anywhere (see README.md):
    /tmp/peftv/bin/python tests/data/peft_adapters/make_adapters.py     # peft 0.21.2, transformers 5.25.0

Every LoRA A/B tensor (B included, so the adapter is not a no-op) is overwritten with
0.1 * N(0, 1) drawn from a numpy generator seeded by the CRC32 of the tensor's *saved* key
(e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); a modules_to_save copy
gets base + 0.1 * N(0, 1), seeded the same way. The base models are loaded through the repo-relative
path `tests/data/hf_models/<arch>_v5` (the process chdirs to the repo root), so that PEFT records
that relative path, not a machine-specific one, as `base_model_name_or_path`. The script re-executes
itself with PYTHONHASHSEED=0 (see main) so that the order of `target_modules` is reproducible.
"""
import argparse
import copy
import json
import os
import shutil
import sys
import zlib

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from safetensors import safe_open
from safetensors.torch import save_file, load_file
from transformers import AutoModelForCausalLM

PEFT_VERSION = "0.21.2"
TRANSFORMERS_VERSION = "5.25.0"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
HF_MODELS_REL = os.path.join("tests", "data", "hf_models")

VOCAB = 96
BATCH, SEQ = 2, 12
COMMON = dict(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")

# name -> (base fixture dir under ../hf_models, LoraConfig kwargs on top of COMMON)
FIXTURES = {
    "llama_qkvo": ("llama_v5", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "llama_all_linear_rslora": ("llama_v5", dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True)),
    "qwen3_all_linear": ("qwen3_v5", dict(r=4, lora_alpha=16, target_modules="all-linear")),
    "gemma3_qv": ("gemma3_v5", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])),
    "phi3_all_linear": ("phi3_v5", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "llama_modules_to_save": ("llama_v5", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               modules_to_save=["lm_head"])),
    # bias="all": every bias trains; an adapted layer's is saved as <module>.base_layer.bias.
    "qwen2_bias_all": ("qwen2_v5", dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], bias="all")),
}


def input_ids():
    """Same ids as ../hf_models/make_fixtures.py (and its reference.safetensors)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)


def noise(key, shape):
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return torch.from_numpy(np.ascontiguousarray(0.1 * rng.standard_normal(shape), dtype=np.float32))


def saved_key(param_name):
    """PEFT parameter name -> key in adapter_model.safetensors (adapter name 'default' dropped)."""
    if ".modules_to_save.default." in param_name:
        return param_name.replace(".modules_to_save.default.", ".")
    if param_name.endswith(".bias") and ".lora_" not in param_name:
        return param_name  # bias="all" / "lora_only": saved under its own name (base_layer.bias when adapted)
    assert ".lora_A.default." in param_name or ".lora_B.default." in param_name, param_name
    return param_name.replace(".default.", ".")


def read_st(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def load_base(base_dir):
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")


PEFT_PREFIX = "base_model.model."


def build(name, base_name, lora_kw, out_dir):
    base_rel = os.path.join(HF_MODELS_REL, base_name)
    base_ref = load_file(os.path.join(base_rel, "reference.safetensors"))
    base_weights = load_file(os.path.join(base_rel, "model.safetensors"))
    torch.manual_seed(0)
    model = get_peft_model(load_base(base_rel), LoraConfig(**{**COMMON, **lora_kw}))

    # Which modules PEFT wrapped, with which scaling.
    wrapped, scalings, mts = [], {}, []
    for n, m in model.named_modules():
        if isinstance(m, LoraLayer):
            assert n.startswith(PEFT_PREFIX), n
            wrapped.append(n[len(PEFT_PREFIX):])
            scalings[n] = m.scaling["default"]
            assert isinstance(m.lora_dropout["default"], torch.nn.Identity), (n, m.lora_dropout)
        elif isinstance(m, ModulesToSaveWrapper):
            mts.append(n[len(PEFT_PREFIX):])
    assert len(set(scalings.values())) == 1, scalings
    scaling = next(iter(scalings.values()))

    # Deterministic, non-zero adapter weights.
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in trainable.items():
            z = noise(saved_key(n), tuple(p.shape))
            if ".modules_to_save." in n or (n.endswith(".bias") and ".lora_" not in n):
                p.add_(z)
            else:
                p.copy_(z)
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout):
            assert m.p == 0.0, (n, m.p)
    for k, v in vars(model.base_model.model.config).items():
        if "dropout" in k or "pdrop" in k:
            assert v in (0, 0.0, None), (k, v)

    # Forward/backward with the adapter (train mode; every dropout probability is 0).
    ids = input_ids()
    assert torch.equal(ids, base_ref["input_ids"]), name
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    with torch.no_grad(), model.disable_adapter():
        base_out = model(input_ids=ids, labels=ids)
    d_base = (base_out.logits - base_ref["logits"]).abs().max().item()
    # Trained biases live in the base layers themselves: disable_adapter() keeps them.
    assert d_base < 1e-5 or lora_kw.get("bias", "none") != "none", (name, d_base)

    ref = {
        "input_ids": ids.clone(),
        "labels": ids.clone(),
        "logits": out.logits.detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(()).contiguous(),
        "base_logits": base_out.logits.detach().float().contiguous(),
    }
    # Gradients named as PEFT names the saved adapter tensors: run the grads through
    # get_peft_model_state_dict in place of the weights.
    sd = dict(model.state_dict())
    for n, p in trainable.items():
        assert p.grad is not None and p.grad.abs().max().item() > 0, (name, n)
        sd[n] = p.grad.detach()
    gsd = get_peft_model_state_dict(model, state_dict=sd)
    assert sorted(gsd) == sorted(saved_key(n) for n in trainable), (name, sorted(gsd))
    for n, p in trainable.items():
        assert torch.equal(gsd[saved_key(n)], p.grad), (name, n)
        ref["grad." + saved_key(n)] = p.grad.detach().float().contiguous()

    # Save the adapter the PEFT way.
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir)
    card = os.path.join(out_dir, "README.md")
    if os.path.exists(card):
        os.remove(card)  # PEFT's model-card template: boilerplate, not needed
    saved, saved_meta = read_st(os.path.join(out_dir, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(saved_key(n) for n in trainable), (name, sorted(saved))
    for n, p in trainable.items():
        assert torch.equal(saved[saved_key(n)], p.detach()), (name, n)
    saved_dtypes = sorted({str(v.dtype) for v in saved.values()})

    # Merged weights (on a deep copy, after the grads were recorded).
    with torch.no_grad():
        merged_model = copy.deepcopy(model).merge_and_unload()
        merged_sd = merged_model.state_dict()
        touched = [f"{m}.weight" for m in wrapped] + [f"{m}.weight" for m in mts]
        if lora_kw.get("bias", "none") != "none":  # the trained biases are merged as they are
            touched += [k for k in base_weights if k.endswith(".bias")]
        for k, v in base_weights.items():
            if k in touched:
                assert not torch.equal(merged_sd[k], v), (name, k)
                ref["merged." + k] = merged_sd[k].detach().float().contiguous()
            else:
                assert torch.equal(merged_sd[k], v), (name, k)
        assert all(k in base_weights for k in touched), (name, touched)
        merged_model.eval()
        d_merged = (merged_model(input_ids=ids).logits - ref["logits"]).abs().max().item()
        # Manual check of the merge formula W + scaling * B @ A on one module.
        m0 = wrapped[0]
        a = saved[f"{PEFT_PREFIX}{m0}.lora_A.weight"]
        b = saved[f"{PEFT_PREFIX}{m0}.lora_B.weight"]
        d_formula = (base_weights[f"{m0}.weight"] + scaling * (b @ a) - merged_sd[f"{m0}.weight"]).abs().max().item()
        assert d_formula < 1e-5, (name, d_formula)

    ref = {k: ref[k] for k in sorted(ref)}
    save_file(ref, os.path.join(out_dir, "reference.safetensors"),
              metadata={"info": json.dumps({"peft_version": peft.__version__,
                                            "transformers_version": transformers.__version__,
                                            "torch_version": torch.__version__, "loss_shape": "[]",
                                            "attn_implementation": "eager", "dtype": "float32",
                                            "base": base_rel.replace(os.sep, "/")}, sort_keys=True)})

    # Reload check: fresh base + PeftModel.from_pretrained(dir) must reproduce the logits.
    reloaded = PeftModel.from_pretrained(load_base(base_rel), out_dir).eval()
    with torch.no_grad():
        d_reload = (reloaded(input_ids=ids).logits - ref["logits"]).abs().max().item()
    assert d_reload < 1e-5, (name, d_reload)

    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        written_cfg = json.load(f)
    expected = {
        "base": base_rel.replace(os.sep, "/"),
        "peft_version": peft.__version__,
        "transformers_version": transformers.__version__,
        "r": lora_kw["r"],
        "lora_alpha": lora_kw["lora_alpha"],
        "use_rslora": bool(lora_kw.get("use_rslora", False)),
        "target_modules_requested": lora_kw["target_modules"],
        "target_modules_in_adapter_config": written_cfg["target_modules"],
        "scaling": scaling,
        "wrapped_modules": wrapped,
        "modules_to_save": mts,
        "adapter_tensors": {k: list(saved[k].shape) for k in sorted(saved)},
        "adapter_tensor_dtypes": saved_dtypes,
        "loss": out.loss.item(),
        "base_loss": base_out.loss.item(),
        "max_abs_logits_minus_base_logits": (ref["logits"] - ref["base_logits"]).abs().max().item(),
    }
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"  {name}: {len(wrapped)} wrapped, scaling {scaling:.6g}, loss {out.loss.item():.6f} "
          f"(base {base_out.loss.item():.6f}), max|logits-base| {expected['max_abs_logits_minus_base_logits']:.3g}, "
          f"base vs hf_models ref {d_base:.3g}, merged vs peft {d_merged:.3g}, reload {d_reload:.3g}, "
          f"adapter metadata {saved_meta}")
    return expected


def main():
    # PEFT turns target_modules into a Python set and writes it to adapter_config.json in set
    # iteration order, which depends on string hashing: pin the hash seed so reruns are byte-identical.
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="fixtures to (re)generate (default: all)")
    a = ap.parse_args()
    assert peft.__version__ == PEFT_VERSION, peft.__version__
    assert transformers.__version__ == TRANSFORMERS_VERSION, transformers.__version__
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.chdir(REPO)
    for name, (base_name, kw) in FIXTURES.items():
        if a.only and name not in a.only:
            continue
        out_dir = os.path.join(HERE, name)
        print(f"{name} (base {base_name}) -> {out_dir}")
        build(name, base_name, kw, out_dir)


if __name__ == "__main__":
    main()
