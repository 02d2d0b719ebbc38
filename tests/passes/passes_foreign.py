"""Foreign exports: `torch.onnx.export` of the HF model itself (not our exporter).

These are the graphs users bring; the passes must fuse them. A thin wrapper gives the HF module
flat past/present KV tensors so both exporters (dynamo and TorchScript) see plain tensors.
"""

from __future__ import annotations

import warnings
from pathlib import Path


def _wrapper(model, n_layers: int, with_cache: bool):  # noqa: ANN202 - a torch module
    import torch
    from transformers import DynamicCache

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, position_ids, *past):  # noqa: ANN001
            if not with_cache:
                out = self.m(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                )
                return out.logits
            cache = DynamicCache(config=self.m.config)
            for i in range(n_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return Flat().eval()


def export_foreign(
    model_dir: str | Path,
    out_path: str | Path,
    *,
    dynamo: bool,
    opset: int,
    with_cache: bool,
) -> Path:
    """Export the HF model in `model_dir` with torch.onnx.export to `out_path` (float32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    kv = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, s, past = 2, 3, 4 if with_cache else 0
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    mask = torch.ones(b, past + s, dtype=torch.int64)
    pos = torch.arange(past, past + s).unsqueeze(0).expand(b, s).contiguous()
    pkv = [torch.randn(b, kv, past, hd) for _ in range(2 * n_layers)] if with_cache else []
    names_in = ["input_ids", "attention_mask", "position_ids"]
    names_out = ["logits"]
    for i in range(n_layers if with_cache else 0):
        names_in += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        names_out += [f"present.{i}.key", f"present.{i}.value"]
    out_path = Path(out_path)
    wrapper = _wrapper(model, n_layers, with_cache)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            D = torch.export.Dim.DYNAMIC
            # one entry per forward argument; *past arrives as one tuple
            dyn: tuple = ({0: D, 1: D}, {0: D, 1: D}, {0: D, 1: D})
            if pkv:
                dyn += (tuple({0: D, 2: D} for _ in pkv),)
            prog = torch.onnx.export(
                wrapper,
                (ids, mask, pos, *pkv),
                dynamo=True,
                opset_version=opset,
                input_names=names_in,
                output_names=names_out,
                dynamic_shapes=dyn,
                optimize=True,
                verbose=False,
            )
            prog.save(str(out_path))
        else:
            axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                    "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
            for n in names_in[3:]:
                axes[n] = {0: "batch", 2: "past"}
            for n in names_out[1:]:
                axes[n] = {0: "batch", 2: "total"}
            torch.onnx.export(
                wrapper,
                (ids, mask, pos, *pkv),
                str(out_path),
                dynamo=False,
                opset_version=opset,
                input_names=names_in,
                output_names=names_out,
                dynamic_axes=axes,
            )
    return out_path
