"""A GGUF's own dequantized weights as an HF float32 folder: the reference the quantization
tables start from (the model `fuselm validate model.gguf OUT` judges against, saved).

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_float_folder.py MODEL.gguf OUT_DIR \
        [--spm-python LLAMA_VENV/bin/python]

OUT_DIR gets config.json, model.safetensors (float32), generation_config.json and the tokenizer
files fuselm stages for the GGUF (converter/gguf_reference.py builds the model). A SentencePiece
vocabulary (`tokenizer.ggml.model` "llama": Gemma's, Llama 2's) is also written as the
tokenizer.model llama.cpp's convert_hf_to_gguf.py reads, pieces, scores and types as the file
holds them, so the GGUFs llama.cpp makes from OUT_DIR carry the same vocabulary; that step runs
in `--spm-python`, a Python with the `sentencepiece` package (the llama.cpp venv has it, fuselm's
does not need it). An OUT_DIR that already holds model.safetensors keeps it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from fuselm.converter.gguf_reference import gguf_reference
from fuselm.export.gguf.file import GGUFFile

# run by --spm-python: a SentencePiece ModelProto from the file's vocabulary (JSON on stdin)
SPM_WRITER = """
import json, sys
from sentencepiece import sentencepiece_model_pb2 as spm
v = json.load(sys.stdin)
m = spm.ModelProto()
m.trainer_spec.model_type = spm.TrainerSpec.BPE
m.trainer_spec.vocab_size = len(v["tokens"])
m.trainer_spec.byte_fallback = True
for field, value in v["ids"].items():
    setattr(m.trainer_spec, field, -1 if value is None else value)
m.normalizer_spec.name = "identity"
m.normalizer_spec.add_dummy_prefix = v["add_space_prefix"]
m.normalizer_spec.remove_extra_whitespaces = False
m.normalizer_spec.escape_whitespaces = True
for piece, score, kind in zip(v["tokens"], v["scores"], v["types"], strict=True):
    p = m.pieces.add()
    p.piece, p.score, p.type = piece, float(score), int(kind)
open(v["out"], "wb").write(m.SerializeToString())
"""


def write_sentencepiece(gguf: GGUFFile, out: Path, python: str) -> bool:
    """tokenizer.model from the file's SentencePiece metadata (False: not such a vocabulary).
    llama.cpp's token types are SentencePiece's piece types (normal 1 ... byte 6)."""
    if gguf.value("tokenizer.ggml.model") != "llama":
        return False
    ids = {field: gguf.value(f"tokenizer.ggml.{key}") for key, field in (
        ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"), ("unknown_token_id", "unk_id"),
        ("padding_token_id", "pad_id"))}
    vocab = {"tokens": gguf.value("tokenizer.ggml.tokens"),
             "scores": gguf.value("tokenizer.ggml.scores"),
             "types": gguf.value("tokenizer.ggml.token_type"), "ids": ids,
             "add_space_prefix": bool(gguf.value("tokenizer.ggml.add_space_prefix", True)),
             "out": str(out / "tokenizer.model")}
    subprocess.run([python, "-c", SPM_WRITER], input=json.dumps(vocab), text=True, check=True)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--spm-python", default=None, help="a Python with sentencepiece")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model.safetensors").exists():
        with gguf_reference(args.gguf) as ref:
            ref.model.save_pretrained(str(out))
            for f in ref.folder.iterdir():
                if f.name != "config.json":  # save_pretrained wrote transformers' own
                    shutil.copy(f, out / f.name)
    if args.spm_python:
        write_sentencepiece(GGUFFile(args.gguf), out, args.spm_python)
    print(out)


if __name__ == "__main__":
    main()
