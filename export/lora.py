"""A PEFT LoRA adapter merged into a checkpoint's float weights as they are read.

`read_adapter(dir)` reads PEFT's `adapter_config.json` + `adapter_model.safetensors` and checks
them against the base checkpoint; `AdaptedCheckpoint` is then the base checkpoint with every
targeted weight merged, the way PEFT's `merge_and_unload` merges a `nn.Linear`:

    W' = W + scale * (B @ A)        A [r, in], B [out, r]   (W as HF stores it, [out, in])
    scale = alpha / r               (alpha / sqrt(r) with use_rslora)

`r` and `alpha` per module follow PEFT's `rank_pattern` / `alpha_pattern` rule (a pattern key
matches a module name it ends, at a dot). The merge is done in float32 and cast to the graph
dtype with the other weights, so quantization (when asked) sees the merged weight.

Tensors of the adapter file that are not LoRA factors replace the base tensor of the same
name: `modules_to_save` (whole modules trained in full) and the biases `bias="all"` /
`"lora_only"` trains (PEFT saves them as `<module>.base_layer.bias` or `<module>.bias`), and the
base weight of a targeted embedding-like layer PEFT saves beside its factors (an LM head's).

`fan_in_fan_out` only concerns GPT-2's Conv1D; every projection of the supported families is an
`nn.Linear`, for which PEFT itself turns the flag off, so the factors always have the shapes
above (and are checked to). Options that change the function (DoRA, LoRA biases, layer
replication, ...) are refused by name. Only safetensors are read: `adapter_model.bin` is a
pickle and is never loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fuselm.export.checkpoint_view import CheckpointView
from fuselm.export.errors import ExportError
from fuselm.export.json_file import read_json
from fuselm.export.safetensors.checkpoint import Checkpoint, cast
from fuselm.input_files import check_regular

if TYPE_CHECKING:
    import torch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PICKLE = "adapter_model.bin"
_PREFIX = "base_model.model."
_FACTOR = re.compile(r"(.+)\.lora_([AB])\.weight")
# adapter_config.json keys that change what the adapted model computes and that fuselm does not
# implement: refused when set (true, or a non-empty value). Every other key is either read
# below or only shapes training (dropout, initialization, inference_mode, ...).
_REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "runtime_config": "runtime options (runtime_config)",
}
# Read here, or training-only: no effect on the merged weights.
_KNOWN = {
    "peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "use_rslora",
    "fan_in_fan_out", "bias", "modules_to_save", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layers_pattern", "task_type", "auto_mapping", "peft_version",
    "base_model_name_or_path", "revision", "inference_mode", "lora_dropout", "init_lora_weights",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config",
    "megatron_core", "qalora_group_size", "ensure_weight_tying", "velora_config",
    "monteclora_config", "kasa_config",
}


class Reader(Protocol):
    """The base checkpoint's side of export/graph_builder.py's WeightReader, plus `info`."""

    root: Path

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def array(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class Factors:
    """One targeted weight's LoRA factors (adapter tensor names) and its merge scale."""

    a: str
    b: str
    rank: int
    scale: float


def _fail(root: Path, what: str) -> ExportError:
    return ExportError(f"adapter {root}: {what}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first key that `module` ends with (at a dot boundary)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _targeted(target: Any, module: str) -> bool:
    """Whether adapter_config.json's target_modules names `module` (PEFT's rule: a string is
    a regex over the whole name, a list holds module names or their last parts)."""
    if isinstance(target, str):
        return target == "all-linear" or re.fullmatch(target, module) is not None
    return any(module == t or module.endswith("." + t) for t in target)


class LoraAdapter:
    """A PEFT LoRA adapter folder, validated against the base checkpoint it will merge into."""

    def __init__(self, path: str | Path, base: Reader) -> None:
        self.root = root = Path(path)
        if not root.is_dir():
            raise _fail(root, "is not a folder; pass a PEFT adapter folder (adapter_config.json "
                        "+ adapter_model.safetensors)")
        if not (root / CONFIG).is_file():
            raise _fail(root, f"no {CONFIG}; pass a PEFT adapter folder ({CONFIG} + {WEIGHTS})")
        check_regular(root / WEIGHTS)
        if not (root / WEIGHTS).is_file():
            if (root / _PICKLE).is_file():
                raise _fail(root, f"holds {_PICKLE}, a pickle, which fuselm never loads; save the "
                            "adapter with safe_serialization=True (PEFT's default) to get "
                            f"{WEIGHTS}")
            raise _fail(root, f"no {WEIGHTS}")
        config = read_json(root / CONFIG, "re-save the adapter with PEFT")
        if not isinstance(config, dict):
            raise _fail(root, f"{CONFIG} is not a JSON object")
        self.config = config
        self._check_config(config)
        self.weights = Checkpoint(root)
        self.factors: dict[str, Factors] = {}  # base weight name -> its factors
        self.replaced: dict[str, str] = {}  # base tensor name -> adapter tensor name
        self._read_tensors(base)

    def _check_config(self, c: dict[str, Any]) -> None:
        if c.get("peft_type") != "LORA":
            raise _fail(self.root, f"peft_type is {c.get('peft_type')!r}; fuselm merges LoRA "
                        "adapters only (peft_type LORA)")
        for key, what in _REFUSED.items():
            if c.get(key):
                raise _fail(self.root, f"uses {what}, which fuselm does not implement; merge it "
                            "with PEFT (merge_and_unload) and convert the merged model")
        unknown = sorted(k for k in c if k not in _KNOWN and k not in _REFUSED and c[k])
        if unknown:
            raise _fail(self.root, f"{CONFIG} sets {', '.join(unknown)}, which fuselm does not "
                        "implement; merge the adapter with PEFT and convert the merged model")
        if c.get("bias", "none") not in ("none", "all", "lora_only"):
            raise _fail(self.root, f"bias is {c.get('bias')!r}; choose none, all or lora_only")
        for key in ("r", "lora_alpha"):
            v = c.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise _fail(self.root, f"{CONFIG}'s {key} is {v!r}, not a positive number")
        for key in ("rank_pattern", "alpha_pattern"):
            if not isinstance(c.get(key) or {}, dict):
                raise _fail(self.root, f"{CONFIG}'s {key} is not an object")
        target = c.get("target_modules")
        if not (isinstance(target, str) or (isinstance(target, list) and target
                                            and all(isinstance(t, str) for t in target))):
            raise _fail(self.root, f"{CONFIG}'s target_modules is {target!r}; PEFT writes a "
                        "list of module names or a regex")
        patterns = [*(c.get("rank_pattern") or {}), *(c.get("alpha_pattern") or {}),
                    *([target] if isinstance(target, str) else [])]
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise _fail(self.root, f"{CONFIG} holds the pattern {pattern!r}, which is not "
                            f"a regular expression ({e})") from None

    def _read_tensors(self, base: Reader) -> None:
        pairs: dict[str, dict[str, str]] = {}
        for name in self.weights.tensors:
            if not name.startswith(_PREFIX):
                raise _fail(self.root, f"tensor {name!r} is not a PEFT adapter tensor "
                            f"(PEFT names start with {_PREFIX!r})")
            rest = name.removeprefix(_PREFIX)
            m = _FACTOR.fullmatch(rest)
            if m:
                pairs.setdefault(m.group(1), {})[m.group(2)] = name
            elif ".lora_" in rest:
                raise _fail(self.root, f"tensor {name!r} is a LoRA factor fuselm does not merge "
                            "(LoRA on embeddings or another layer type); only linear "
                            "projections are merged")
            else:  # modules_to_save, trained biases: a whole replacement of the base tensor
                target = rest.replace(".base_layer.", ".")
                self._check_same_shape(base, target, name)
                self.replaced[target] = name
        target = self.config["target_modules"]
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                missing = "lora_B" if "A" in ab else "lora_A"
                raise _fail(self.root, f"{module} has no {missing}; the adapter file is "
                            "incomplete")
            weight = f"{module}.weight"
            if not base.has(weight):
                raise _fail(self.root, f"targets {module}, which the base model in {base.root} "
                            "does not have; the adapter was trained on another model")
            if not _targeted(target, module):
                raise _fail(self.root, f"holds LoRA factors for {module}, which {CONFIG}'s "
                            f"target_modules ({target}) does not name")
            self.factors[weight] = self._factors(base, module, ab["A"], ab["B"])
        if isinstance(target, list):
            unused = [t for t in target if not any(_targeted([t], m) for m in pairs)]
            if unused:
                raise _fail(self.root, f"{CONFIG}'s target_modules names {', '.join(unused)} but "
                            f"{WEIGHTS} holds no LoRA factors for it; the base model has no such "
                            "module, or the adapter file is incomplete")
        if not self.factors and not self.replaced:
            raise _fail(self.root, f"{WEIGHTS} holds no LoRA factors")

    def _check_same_shape(self, base: Reader, target: str, name: str) -> None:
        if not base.has(target):
            raise _fail(self.root, f"replaces {target} (tensor {name!r}), which the base model "
                        f"in {base.root} does not have; the adapter was trained on another model")
        have, want = self.weights.shape(name), base.shape(target)
        if tuple(have) != tuple(want):
            raise _fail(self.root, f"tensor {name!r} has shape {list(have)} but the base "
                        f"model's {target} has {list(want)}; the adapter was trained on "
                        "another model")

    def _factors(self, base: Reader, module: str, a: str, b: str) -> Factors:
        c = self.config
        rank = int(_pattern_value(c.get("rank_pattern") or {}, module, c["r"]))
        alpha = float(_pattern_value(c.get("alpha_pattern") or {}, module, c["lora_alpha"]))
        a_shape, b_shape = self.weights.shape(a), self.weights.shape(b)
        out_in = tuple(base.shape(f"{module}.weight"))
        if len(out_in) != 2 or a_shape != (rank, out_in[1]) or b_shape != (out_in[0], rank):
            raise _fail(self.root, f"{module}'s factors have shapes lora_A {list(a_shape)}, "
                        f"lora_B {list(b_shape)}; rank {rank} over the base weight "
                        f"{list(out_in)} needs [{rank}, {out_in[-1]}] and [{out_in[0]}, {rank}]"
                        " (a rank or base-model mismatch)")
        scale = alpha / math.sqrt(rank) if c.get("use_rslora") else alpha / rank
        return Factors(a, b, rank, scale)

    def touched(self) -> set[str]:
        """Every base tensor the adapter changes."""
        return {*self.factors, *self.replaced}

    def check_untied(self, tied: bool) -> None:
        """A tied embedding / LM head is one table in the graph; PEFT changes one of the two."""
        both = sorted(self.touched() & {"lm_head.weight", "model.embed_tokens.weight"})
        if tied and both:
            raise _fail(self.root, f"changes {both[0]} of a model whose embeddings and LM head "
                        "are tied (one table in fuselm's graph); merge it with PEFT and convert "
                        "the merged model")

    def record(self) -> dict[str, Any]:
        """fuselm.json's account of the merge."""
        ranks = sorted({f.rank for f in self.factors.values()})
        return {"path": str(self.root.resolve()), "merged": len(self.factors),
                "replaced": len(self.replaced), "ranks": ranks,
                "rslora": bool(self.config.get("use_rslora"))}

    def merged(self, name: str, w: np.ndarray) -> np.ndarray:
        """The base tensor `name` (values `w`) with the adapter applied, float32."""
        if name in self.replaced:  # a saved base layer (an LM head's) may carry factors too
            w = self.weights.array(self.replaced[name])
        w = cast(w, np.float32)
        f = self.factors.get(name)
        if f is None:
            return w
        a = cast(self.weights.array(f.a), np.float32)
        b = cast(self.weights.array(f.b), np.float32)
        return w + np.float32(f.scale) * (b @ a)


class AdaptedCheckpoint(CheckpointView):
    """The base checkpoint with the adapter merged into the tensors it touches."""

    def __init__(self, base: Checkpoint, adapter: LoraAdapter) -> None:
        super().__init__(base)
        self.adapter = adapter

    def same_values(self, a: str, b: str) -> bool:
        touched = self.adapter.touched()
        if a in touched or b in touched:
            return bool(np.array_equal(self.array(a), self.array(b)))
        return self.base.same_values(a, b)

    def array(self, name: str) -> np.ndarray:
        if name in self.adapter.touched():
            return self.adapter.merged(name, self.base.array(name))
        return self.base.array(name)

    def get(self, name: str) -> torch.Tensor:
        import torch

        if name in self.adapter.touched():
            return torch.from_numpy(self.array(name))
        return self.base.get(name)
