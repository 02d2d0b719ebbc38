"""fuselm.json's records: the dataclasses that artifact.py reads and writes and
manifest_schema.py checks (a leaf module, so the two never import each other)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from fuselm.errors import FuselmError

FORMAT = "fuselm"
FORMAT_VERSION = 1


class ArtifactError(FuselmError):
    """A fuselm output directory that cannot be read; the message says what to do."""


@dataclass
class ModelInfo:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    context_length: int
    sliding_window: int | None = None
    parameters: int | None = None  # every weight, as transformers' num_parameters() counts


@dataclass
class RopeInfo:
    type: str  # default | linear | dynamic | llama3 | yarn | none
    theta: float
    rotary_dim: int
    attention_scale: float = 1.0
    interleaved: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Manifest:
    model: ModelInfo
    rope: RopeInfo
    dtype: str  # float activations/weights of the graph: float32 | float16 | bfloat16
    special_tokens: dict[str, Any]  # bos: int|None, eos: [int], pad: int|None
    source: dict[str, Any]  # path, checkpoint dtype, shards
    versions: dict[str, str]
    quantization: dict[str, Any] | None = None
    passes: dict[str, Any] = field(default_factory=dict)  # the pass manager's report
    steps: list[str] = field(default_factory=list)  # what was done, in order
    files: dict[str, Any] = field(default_factory=dict)
    integrity: dict[str, Any] | None = None  # sizes and hashes of the files (integrity.py)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.special_tokens.get("eos") or []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
