"""Phi-3 (Phi3ForCausalLM): the checkpoint holds q/k/v fused as `qkv_proj` ([Wq; Wk; Wv] along
the output axis) and gate/up as `gate_up_proj` ([Wg; Wu]); each projection reads its rows of
the fused tensor, and the passes pack them back into FusedQKV / FusedGateUp. `sliding_window`
(when set) applies to every layer."""

from typing import Any

from fuselm.export.config import DecoderSpec
from fuselm.export.family import Family, Source, register


@register("Phi3ForCausalLM")
class Phi3(Family):
    model_type = "phi3"

    def windows(self, hf: Any, layers: int) -> list[int | None]:
        window = getattr(hf, "sliding_window", None)
        return [int(window) if window else None] * layers

    def layer_source(self, spec: DecoderSpec, i: int, local: str, kind: str) -> Source:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        fused = {
            "q_proj": ("self_attn.qkv_proj", (0, q)),
            "k_proj": ("self_attn.qkv_proj", (q, q + kv)),
            "v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
            "gate_proj": ("mlp.gate_up_proj", (0, spec.intermediate_size)),
            "up_proj": ("mlp.gate_up_proj", (spec.intermediate_size, 2 * spec.intermediate_size)),
        }
        if local not in fused or kind != "weight":
            return super().layer_source(spec, i, local, kind)
        name, rows = fused[local]
        return Source(f"model.layers.{i}.{name}.weight", transpose=True, rows=rows)
