"""Write a random-weight HF checkpoint of a large shape, shard by shard, without holding it.

    python benchmarks/make_checkpoint.py OUT_DIR [--shape llama-3.1-8b] [--layers N]

The checkpoint is a real HF directory: config.json (from transformers' own config class),
a small trained tokenizer (converter/models/builtin.py's; its ids lie below
the vocabulary size, which is all convert checks), and bfloat16 safetensors shards with
`model.safetensors.index.json`. Each shard (one per decoder layer, one for the embedding, one
for the LM head and final norm) is generated, written and freed before the next, so memory
stays at the largest shard (the 128256 × 4096 embedding: 1 GB in bfloat16) however large
the model is. Weights are seeded normal(0, 0.02) as HF initializes them; norms are
1 + 0.1 · normal so that they are not all ones. `--device cuda` draws them on the GPU (the
16 GB of the 8B shape in seconds instead of minutes on the CPU; other numbers than the CPU's
for the same seed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHAPES = {
    "llama-3.1-8b": {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 500000.0,
    },
}


def _layer(i: int, cfg: dict, gen, torch) -> dict:  # noqa: ANN001 - torch module, Generator
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {
        "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    out = {f"model.layers.{i}.{k}": _normal(s, gen, torch) for k, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = _norm(h, gen, torch)
    return out


def _normal(shape: tuple[int, ...], gen, torch):  # noqa: ANN001, ANN202
    # drawn straight into bfloat16: no float32 copy of the tensor
    t = torch.empty(shape, dtype=torch.bfloat16, device=gen.device)
    return t.normal_(0.0, 0.02, generator=gen).cpu()


def _norm(n: int, gen, torch):  # noqa: ANN001, ANN202
    return (1 + 0.1 * torch.randn(n, generator=gen, device=gen.device)).to(torch.bfloat16).cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the depth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the numbers are drawn (cpu, cuda)")
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors.torch import save_file

    from fuselm.converter.models.builtin import build_tokenizer

    t0 = time.perf_counter()
    cfg = dict(SHAPES[args.shape])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2,
                                      torch_dtype="bfloat16",
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(out)
    build_tokenizer(out, cfg["vocab_size"])
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    n = cfg["num_hidden_layers"]
    shards = [("embed", None), *((f"layer{i}", i) for i in range(n)), ("head", None)]
    weight_map: dict[str, str] = {}
    total = 0
    for k, (tag, layer) in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        if tag == "embed":
            tensors = {"model.embed_tokens.weight":
                       _normal((cfg["vocab_size"], cfg["hidden_size"]), gen, torch)}
        elif tag == "head":
            tensors = {"lm_head.weight": _normal((cfg["vocab_size"], cfg["hidden_size"]), gen,
                                                 torch),
                       "model.norm.weight": _norm(cfg["hidden_size"], gen, torch)}
        else:
            tensors = _layer(layer, cfg, gen, torch)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    print(json.dumps({"out_dir": str(out), "shape": args.shape, "layers": n,
                      "bytes": total, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
